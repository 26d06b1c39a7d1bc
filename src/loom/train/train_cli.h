// The `loom train` and `loom plot` commands.
#pragma once
#include <CLI/CLI.hpp>

namespace loom::train {
// `loom train`: one rank of a training job.
void register_train_command(CLI::App& app);
// `loom plot RUN_DIR [RUN_DIR ...] [--out loss.svg]`: training curves of one or more runs as SVG.
void register_plot_command(CLI::App& app);
}  // namespace loom::train
