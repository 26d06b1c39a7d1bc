// The `loom launch` command.
#pragma once
#include <CLI/CLI.hpp>

namespace loom::distributed {
// `loom launch`: start and supervise local ranks (registered on the `loom` app by apps/main.cpp).
void register_launch_command(CLI::App& app);
}  // namespace loom::distributed
