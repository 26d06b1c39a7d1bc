// Learning-rate schedule: linear warmup, optional stable phase, then linear / sqrt / cosine decay
// towards min_lr_factor (Warmup-Stable-Decay, arXiv:2404.06395). Mirrors TorchTitan's
// linear_warmup_stable_decay used through LambdaLR, including its step indexing:
//   - factor(s) is the multiplier for scheduler step s (0-based); training step k (1-based) runs
//     with factor(k - 1) because the scheduler advances after each optimizer step;
//   - warmup: factor(s) = (s + 1) / warmup_steps, reaching 1 on the last warmup step;
//   - decay_steps = round(steps * decay_ratio) (ties to even, like Python), or all steps after
//     warmup when decay_ratio is unset; one virtual step is added to the stable phase so the last
//     training step does not run at exactly min_lr_factor;
//   - decay progress p = (s + 1 - warmup - stable) / decay_steps, factor = min + (1 - min) * f(p)
//     with f = 1 - p (linear), 1 - sqrt(p) (sqrt), (1 + cos(pi p)) / 2 (cosine).
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

#include "loom/core/options.h"
#include "loom/optim/optimizer.h"

namespace loom::optim {

enum class DecayType { kLinear, kSqrt, kCosine };

// lr_scheduler.decay_type: "linear" | "sqrt" | "cosine" (core/options.h's enum protocol).
const options::EnumNames<DecayType>& option_names(DecayType);

// The [lr_scheduler] section of a job config (lr_scheduler_section() is its schema).
struct LRScheduleOptions {
  int64_t warmup_steps = 200;
  // Fraction of training steps spent decaying at the end (WSD); unset = decay right after warmup.
  std::optional<double> decay_ratio;
  DecayType decay_type = DecayType::kLinear;
  // The decay ends at lr * min_lr_factor instead of 0.
  double min_lr_factor = 0.0;

  bool operator==(const LRScheduleOptions&) const = default;
};
const options::Section& lr_scheduler_section();

// The phase lengths resolved for a run of `training_steps`, and the multiplier per step.
struct WarmupStableDecaySchedule {
  int64_t warmup_steps = 0;
  int64_t stable_steps = 0;  // includes TorchTitan's one virtual step past the end
  int64_t decay_steps = 0;
  DecayType decay_type = DecayType::kLinear;
  double min_lr_factor = 0.0;

  // Resolves phase lengths as TorchTitan does, logging a warning when warmup (or warmup + decay)
  // exceeds the run and is shortened. Throws loom::UsageError on negative or out-of-range inputs.
  static WarmupStableDecaySchedule make(const LRScheduleOptions& options, int64_t training_steps);

  // Multiplier of the base lr at 0-based scheduler step `step`; past the end it stays at the
  // final value.
  double factor(int64_t step) const;
};

// Drives an optimizer's lr like torch.optim.lr_scheduler.LambdaLR: the constructor sets
// lr = base_lr * factor(0) (base_lr is the optimizer's lr at construction); step(), called after
// each optimizer step, advances one step and sets the next lr. The optimizer must outlive it.
class LRScheduler {
 public:
  LRScheduler(Optimizer& optimizer, const LRScheduleOptions& options, int64_t training_steps);

  void step();
  double lr() const { return base_lr_ * schedule_.factor(last_step_); }
  double base_lr() const { return base_lr_; }
  int64_t last_step() const { return last_step_; }
  const WarmupStableDecaySchedule& schedule() const { return schedule_; }

  // {"last_step": 0-dim int64}; loading sets the optimizer's lr for that step.
  TensorDict state_dict() const;
  void load_state_dict(const TensorDict& state);

 private:
  Optimizer& optimizer_;
  double base_lr_;
  WarmupStableDecaySchedule schedule_;
  int64_t last_step_ = 0;
};

}  // namespace loom::optim
