// `loom plan`: the parallel layouts of a run's model on a number of devices, with the memory each
// needs per device (plan/memory_model.h); `--explain` breaks down one layout, the config's own.
#pragma once
#include <CLI/CLI.hpp>

namespace loom::plan {
void register_plan_command(CLI::App& app);
}  // namespace loom::plan
