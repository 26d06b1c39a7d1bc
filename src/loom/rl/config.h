// The [rl] section of a `loom rl` job config (issue 51): GRPO on a LoRA adapter. The rest of the
// file is an ordinary job config: [model] and [checkpoint].initial_load_path name the base (an SFT
// run's checkpoint, a Hugging Face folder), [lora] the adapters trained, [optimizer] their
// optimizer (lr, weight_decay), [training] steps, seed and max_norm, [job] dump_folder where
// metrics.jsonl and the adapter revisions go.
#pragma once
#include <cstdint>
#include <string>

#include "loom/core/options.h"
#include "loom/models/common/generate.h"
#include "loom/rl/grpo.h"

namespace loom::rl {

enum class RewardKind { kExact, kNumeric, kCommand };
const options::EnumNames<RewardKind>& option_names(RewardKind);

struct RlConfig {
  std::string prompts;               // JSONL: {"prompt": ..., "answer": ...} per line
  int64_t prompts_per_step = 4;      // P
  int64_t group_size = 4;            // G completions per prompt
  int64_t max_new_tokens = 16;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  RewardKind reward = RewardKind::kExact;
  std::string reward_command;        // reward = "command": ExternalReward's command
  int64_t reward_timeout_seconds = 60;
  double numeric_tolerance = 1e-6;
  double clip_low = 0.2;
  double clip_high = 0.2;
  double kl_beta = 0.0;
  LossAggregation loss_type = LossAggregation::kSequenceMean;
  AdvantageScale scale_rewards = AdvantageScale::kGroupStd;
  int64_t updates_per_rollout = 1;  // optimizer steps on each batch of rollouts (GRPO's mu)
  int64_t save_every = 0;            // 0: only at the end
  bool add_bos = false;              // prepend the tokenizer's BOS to each prompt
  bool resume = false;               // continue from the newest revision in dump_folder/adapters
  std::string rollback;              // a revision directory to restart from (revisions.h)
  std::string policies;              // "a,b,c": one adapter per name over one base; "" = one policy

  GrpoOptions grpo() const;
  // The rollouts' sampling (max_new_tokens, temperature, top_p, top_k), stopping after `stop_id`
  // (the tokenizer's EOS): the same for the single-process and the parallel loop.
  models::SamplingOptions sampling(int64_t stop_id) const;
  bool operator==(const RlConfig&) const = default;
};
const options::Section& rl_section();

// The [rl] section's reference in docs/config.md's format (each key's type, default and meaning):
// `loom rl --config-reference` prints it and `make docs` appends it to the page below
// kRlReferenceMarker, after `loom train --config-reference` (train does not know rl, which sits
// after it in the folder order); RlLoop.ConfigReferenceIsInTheDocs checks the page.
std::string rl_reference_markdown();
inline constexpr const char* kRlReferenceMarker = "<!-- [rl] generated below by `loom rl --config-reference`";

}  // namespace loom::rl
