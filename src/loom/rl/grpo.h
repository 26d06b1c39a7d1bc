// GRPO (Group Relative Policy Optimization; DeepSeekMath, Shao et al. 2024), the objective of
// `issue 51`'s RL loop, as TRL's GRPOTrainer computes it:
//
//   advantages  each prompt's G completions are a group; A_i = (r_i - mean(r)) / (std(r) + eps)
//               with the group's unbiased std (TRL's scale_rewards = "group"), or r_i - mean(r)
//               unscaled (Dr. GRPO, scale_rewards = "none"). A group whose rewards are all equal
//               has A = 0: it teaches nothing, and says so in the stats.
//   per token   ratio = exp(logp - logp_old);
//               loss_t = -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)
//                        + beta (exp(logp_ref - logp) - (logp_ref - logp) - 1)   (k3 KL, beta > 0)
//   aggregate   kSequenceMean ("grpo"): each completion's mean over its tokens, then the mean over
//               completions; kTokenMean ("bnpo"): the sum over every token / the number of tokens;
//               kDrGrpo ("dr_grpo"): the sum / (completions x max_completion_length).
//
// logp_old is the rollout policy's log-probability of each sampled token (detached: the ratio's
// gradient flows through logp only); with one update per rollout logp_old = logp.detach() and the
// ratio is 1 with a gradient of A. logp_ref is the reference (the base with the adapter detached).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "loom/core/options.h"

namespace loom::rl {

enum class AdvantageScale { kGroupStd, kNone };
enum class LossAggregation { kSequenceMean, kTokenMean, kDrGrpo };
// "group" | "none" and "grpo" | "bnpo" | "dr_grpo" (core/options.h's enum protocol).
const options::EnumNames<AdvantageScale>& option_names(AdvantageScale);
const options::EnumNames<LossAggregation>& option_names(LossAggregation);

// rewards [P * G] (float, the G completions of each prompt consecutive) -> advantages [P * G],
// float32. loom::UsageError for G < 2 (no group to be relative to) or a length not a multiple of G.
torch::Tensor group_advantages(const torch::Tensor& rewards, int64_t group_size,
                               AdvantageScale scale = AdvantageScale::kGroupStd, double eps = 1e-4);

struct GrpoOptions {
  double clip_low = 0.2;   // epsilon_low
  double clip_high = 0.2;  // epsilon_high (DAPO's clip-higher raises it)
  double kl_beta = 0.0;    // 0: no KL term (logp_ref unused)
  LossAggregation aggregation = LossAggregation::kSequenceMean;
  // kDrGrpo's denominator is completions x this (TRL's max_completion_length: the longest a
  // completion may be, rl.max_new_tokens in `loom rl`); 0: the log-probabilities' width T.
  int64_t max_completion_length = 0;
  void validate() const;   // one-line loom::UsageError naming the field
};

struct GrpoLoss {
  torch::Tensor loss;  // scalar, differentiable in logp
  // Over the trained (masked-in) tokens, detached: the mean k3 KL (0 without a reference), the
  // shares clipped below 1 - clip_low (with A < 0) and above 1 + clip_high (with A > 0), the mean ratio.
  double kl = 0, clipped_low = 0, clipped_high = 0, ratio = 1;
};

// logp, logp_old (and logp_ref when kl_beta > 0) [B, T] float: the log-probability of each sampled
// completion token under the current, rollout (and reference) policy; advantages [B]; mask [B, T]
// bool or 0/1 (the completion's tokens; padding and prompt 0). Every completion must have a token.
GrpoLoss grpo_loss(const torch::Tensor& logp, const torch::Tensor& logp_old, const torch::Tensor& logp_ref,
                   const torch::Tensor& advantages, const torch::Tensor& mask, const GrpoOptions& options);

}  // namespace loom::rl
