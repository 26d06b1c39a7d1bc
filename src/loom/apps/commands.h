// Each `loom` subcommand lives beside the concept it drives and registers itself on the CLI11 app.
// main() only calls these in order; a command's callback throws loom::Error on bad input.
#pragma once
#include <CLI/CLI.hpp>

namespace loom::apps {
void register_launch_command(CLI::App& app);     // dist/launcher_cli.cpp
void register_train_command(CLI::App& app);      // train/train_cli.cpp
void register_score_command(CLI::App& app);      // models/llama3/score_cli.cpp
void register_tokenizer_command(CLI::App& app);  // data/tokenizer_cli.cpp
void register_info_command(CLI::App& app);       // models/llama3/info_cli.cpp
void register_convert_command(CLI::App& app);    // models/llama3/convert_cli.cpp
}  // namespace loom::apps
