// `loom rl --config FILE`: GRPO on LoRA adapters (issue 51; docs in src/loom/rl/config.h).
#pragma once
#include <CLI/CLI.hpp>

#include <string>
#include <utility>

#include "loom/rl/config.h"
#include "loom/train/config.h"

namespace loom::rl {
// A job config file with an [rl] section: the [rl] table parsed by rl_section(), the rest as any
// `loom train` config; both validated. One-line loom::UsageErrors.
std::pair<train::JobConfig, RlConfig> load_rl_config(const std::string& path);
void register_rl_command(CLI::App& app);
}  // namespace loom::rl
