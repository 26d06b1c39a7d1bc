// The `loom launch` command.
#pragma once
#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "loom/distributed/rank_fork_server.h"

namespace loom::distributed {
// `loom launch`: start and supervise local ranks (registered on the `loom` app by apps/main.cpp).
// `typed`: the command line as typed (argv), so a hint can quote the user's words in their order
// (CLI11 hands positionals and unknown options over separately). `entry`: the executable's main,
// which ranks forked by the fork server run (--start-method forkserver, the default); without it
// ranks are exec'd.
void register_launch_command(CLI::App& app, std::vector<std::string> typed = {}, RankEntry entry = {});
}  // namespace loom::distributed
