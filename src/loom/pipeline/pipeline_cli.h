// The `loom pipeline` command.
#pragma once
#include <CLI/CLI.hpp>

namespace loom::pipeline {
// `loom pipeline schedule` (print and simulate one schedule) and `loom pipeline compare` (every
// schedule at one pp and micro-batch count).
void register_pipeline_command(CLI::App& app);
}  // namespace loom::pipeline
