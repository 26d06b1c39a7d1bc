// The model commands of the `loom` CLI, for every registered model (models/spec.h).
#pragma once
#include <CLI/CLI.hpp>

namespace loom::models {
// `loom score`, `loom generate`, `loom info` and `loom convert`.
void register_score_command(CLI::App& app);
void register_generate_command(CLI::App& app);
void register_info_command(CLI::App& app);
void register_convert_command(CLI::App& app);
}  // namespace loom::models
