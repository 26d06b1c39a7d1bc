// `loom rl --config FILE`: GRPO on LoRA adapters (issue 51; docs in src/loom/rl/config.h).
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "loom/data/tokenizer.h"
#include "loom/rl/config.h"
#include "loom/train/config.h"

namespace loom::rl {
// A job config file with an [rl] section: the [rl] table parsed by rl_section(), the rest as any
// `loom train` config, then the command-line `overrides` (--rl.key=value for the [rl] table,
// --section.key=value for the rest, as `loom train` takes them); both validated. One-line
// loom::UsageErrors.
std::pair<train::JobConfig, RlConfig> load_rl_config(const std::string& path,
                                                    const std::vector<std::string>& overrides = {});
void register_rl_command(CLI::App& app);

struct Prompt {
  std::string text, answer;
  std::vector<int64_t> ids;
};
// rl.prompts: one {"prompt": ..., "answer": ...} per line (blank lines skipped), tokenized (BOS
// when add_bos). A malformed line, an empty prompt, or one that leaves no room for max_new_tokens
// in max_seq_len is a one-line loom::UsageError naming FILE:LINE; so is a file without prompts.
std::vector<Prompt> read_prompts(const std::string& path, const loom::data::Tokenizer& tokenizer, bool add_bos,
                                 int64_t max_new_tokens, int64_t max_seq_len);
}  // namespace loom::rl
