// The Llama 3 commands of the `loom` CLI.
#pragma once
#include <CLI/CLI.hpp>

namespace loom::llama3 {
// `loom score`, `loom info` and `loom convert` for Llama 3 models.
void register_score_command(CLI::App& app);
void register_generate_command(CLI::App& app);
void register_info_command(CLI::App& app);
void register_convert_command(CLI::App& app);
}  // namespace loom::llama3
