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
// Runs the job `loom rl --config config_path` describes (metrics.jsonl and adapters/ under
// job.dump_folder), with the command-line `overrides`: in this process, or, launched on several
// ranks or with a parallel degree above 1, run_parallel_rl's loop.
void run_rl(const std::string& config_path, const std::vector<std::string>& overrides = {});
// Whether `job` runs under parallelism: launched on several ranks (WORLD_SIZE > 1) or a degree of
// [parallelism] above 1.
bool parallel_job(const train::JobConfig& job);
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
// The loop over ParallelPolicy (parallel_loop.cpp): rollouts split over the data-parallel ranks,
// sampled one completion at a time in lockstep, the update under the composition.
void run_parallel_rl(const train::JobConfig& job, const RlConfig& rl, const data::Tokenizer& tokenizer);
}  // namespace loom::rl
