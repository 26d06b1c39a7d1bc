// The `loom train` command.
#pragma once
#include <CLI/CLI.hpp>

namespace loom::train {
// `loom train`: one rank of a training job.
void register_train_command(CLI::App& app);
}  // namespace loom::train
