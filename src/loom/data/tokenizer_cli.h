// The `loom tokenizer` command.
#pragma once
#include <CLI/CLI.hpp>

namespace loom::data {
// `loom tokenizer`: train, encode and pretokenize.
void register_tokenizer_command(CLI::App& app);
}  // namespace loom::data
