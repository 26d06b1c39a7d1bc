// The update half of a GRPO step on LoRA adapters (issue 51), run as the Trainer runs its own
// optimizer step: the optimizer optimizer.name builds (parallel/optimizer_registry.h: Loom's AdamW
// by default, weight-decay groups by optim::weight_decay_param_groups) over the adapters, the
// [lr_scheduler] schedule advanced after every optimizer step, and the gradients clipped by their
// global norm to training.max_norm before the step (0: not clipped; the norm is still reported).
// A non-finite loss or norm stops the run with one line before the adapters change (the Trainer's
// training.skip_nonfinite_steps has no counterpart here), so no revision ever holds NaNs.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "loom/models/common/decoder.h"
#include "loom/optim/lr_scheduler.h"
#include "loom/optim/optimizer.h"
#include "loom/rl/grpo.h"
#include "loom/rl/rollout.h"
#include "loom/train/config.h"

namespace loom::rl {

// Called after backward and before clipping, with the trained parameters (their .grad() set).
using GradientInspector = std::function<void(const optim::NamedTensors& trained)>;

class AdapterOptimizer {
 public:
  // Over `model`'s trainable parameters (its adapters: everything else is frozen); the schedule
  // spans `total_updates` optimizer steps (training.steps x rl.updates_per_rollout).
  AdapterOptimizer(models::Decoder& model, const train::JobConfig& job, int64_t total_updates);

  struct Update {
    double grad_norm = 0;  // before clipping
    double lr = 0;         // the step's learning rate
  };
  // Zeroes the gradients, back-propagates `loss`, clips, steps the optimizer and the schedule.
  Update step(const torch::Tensor& loss, const GradientInspector& inspect = nullptr);

  const optim::NamedTensors& trained() const { return trained_; }
  // The optimizer's state ("optimizer.<key>") and the schedule's ("lr_scheduler.<key>"), live
  // tensors: clone to keep a snapshot. Loading copies in place and sets the schedule's lr.
  optim::TensorDict state_dict() const;
  void load_state_dict(const optim::TensorDict& state);

 private:
  optim::NamedTensors trained_;
  double max_norm_ = 0;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::unique_ptr<optim::LRScheduler> schedule_;
};

// The current policy's log-probabilities of `batch` by a no-grad training forward: GRPO's old
// log-probabilities for a step's updates (as TRL recomputes them), equal to the sampler's up to
// rounding that depends on how the rows were decoded.
torch::Tensor recomputed_logprobs(models::Decoder& model, const Batch& batch, double temperature);

// The reference policy's log-probabilities for the KL term: the base, every adapter switched off
// (lora::Adapter::set_enabled) for one no-grad forward, as parallel_loop.cpp does under FSDP.
torch::Tensor reference_logprobs(models::Decoder& model, const Batch& batch, double temperature);

struct PolicyUpdate {
  GrpoLoss loss;             // the last update's
  double grad_norm = 0;      // the last update's, before clipping
  double lr = 0;             // the last update's
  double max_logp_diff = 0;  // the first update's |training forward - rollout| log-probs (same weights)
};
// `updates` optimizer steps of GRPO on one batch of rollouts: each recomputes the log-probabilities
// (token_logprobs), the loss against the rollout's (`old`) and the reference's (`ref`, undefined
// without a KL term), and steps `optimizer`.
PolicyUpdate update_policy(models::Decoder& model, AdapterOptimizer& optimizer, const Batch& batch,
                           const torch::Tensor& old, const torch::Tensor& ref, const torch::Tensor& advantages,
                           const GrpoOptions& grpo, double temperature, int64_t updates,
                           const GradientInspector& inspect = nullptr);

}  // namespace loom::rl
