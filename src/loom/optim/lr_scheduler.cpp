#include "loom/optim/lr_scheduler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/logging.h"

namespace loom::optim {

const options::EnumNames<DecayType>& option_names(DecayType) {
  static const options::EnumNames<DecayType> names = {
      {"linear", DecayType::kLinear}, {"sqrt", DecayType::kSqrt}, {"cosine", DecayType::kCosine}};
  return names;
}

namespace {
void check_lr_scheduler(const LRScheduleOptions& o) {
  const options::Section& s = lr_scheduler_section();
  options::require(o.warmup_steps >= 0, s, "warmup_steps", ">= 0", &o);
  options::require(!o.decay_ratio || *o.decay_ratio <= 1.0, s, "decay_ratio", "in [0, 1] or unset", &o);
  options::require(o.min_lr_factor >= 0.0 && o.min_lr_factor <= 1.0, s, "min_lr_factor", "in [0, 1]", &o);
}
}  // namespace

const options::Section& lr_scheduler_section() {
  using S = LRScheduleOptions;
  static const options::Section section{
      "lr_scheduler",
      {
          {LOOM_OPTION(S, warmup_steps), "Linear warmup steps (shortened to `training.steps` if longer)."},
          {LOOM_OPTION(S, decay_ratio),
           "Fraction of the steps spent decaying at the end, in [0, 1] (Warmup-Stable-Decay, "
           "arXiv:2404.06395). Unset, a negative value in TOML, or `none` on the command line = decay"
           " over all steps after warmup."},
          {LOOM_OPTION(S, decay_type), "Shape of the decay."},
          {LOOM_OPTION(S, min_lr_factor), "The decay ends at `lr * min_lr_factor`, in [0, 1]."},
      },
      R"md(Linear warmup, an optional stable phase, then decay: TorchTitan's `linear_warmup_stable_decay`.
Training step *k* (1-based) runs at `lr * factor(k - 1)`:

- warmup (`k <= warmup_steps`): `factor = k / warmup_steps`, so the first step runs at
  `lr / warmup_steps` and the last warmup step at `lr`;
- `decay_steps = round(steps * decay_ratio)` (or `steps - warmup_steps` when `decay_ratio` is
  unset), shortened if warmup + decay exceed the run; the stable phase is what is left plus one
  virtual step, so the last training step is not at exactly the floor;
- decay: with progress `p = (k - warmup - stable) / decay_steps`, `factor = min_lr_factor +
  (1 - min_lr_factor) * f(p)`, `f = 1 - p` (linear), `1 - sqrt(p)` (sqrt) or `(1 + cos(pi p)) / 2`
  (cosine).)md",
      {},
      &options::validate_as<S, check_lr_scheduler>};
  return section;
}

WarmupStableDecaySchedule WarmupStableDecaySchedule::make(const LRScheduleOptions& options,
                                                          int64_t training_steps) {
  LOOM_REQUIRE_USAGE(training_steps > 0, "training.steps must be > 0 for the lr schedule, got ",
                     training_steps);
  LOOM_REQUIRE_USAGE(options.warmup_steps >= 0, "lr_scheduler.warmup_steps must be >= 0, got ",
                     options.warmup_steps);
  LOOM_REQUIRE_USAGE(options.min_lr_factor >= 0.0 && options.min_lr_factor <= 1.0,
                     "lr_scheduler.min_lr_factor must be in [0, 1], got ", options.min_lr_factor);
  WarmupStableDecaySchedule s;
  s.decay_type = options.decay_type;
  s.min_lr_factor = options.min_lr_factor;
  s.warmup_steps = options.warmup_steps;
  if (s.warmup_steps > training_steps) {
    log::warn("warmup steps (", s.warmup_steps, ") exceed total training steps (", training_steps,
              "); using ", training_steps);
    s.warmup_steps = training_steps;
  }
  if (options.decay_ratio.has_value()) {
    const double ratio = *options.decay_ratio;
    LOOM_REQUIRE_USAGE(ratio >= 0.0 && ratio <= 1.0,
                       "lr_scheduler.decay_ratio must be in [0, 1] (or unset), got ", ratio);
    // std::nearbyint rounds half to even under the default rounding mode, like Python's round().
    s.decay_steps = static_cast<int64_t>(std::nearbyint(static_cast<double>(training_steps) * ratio));
    if (s.warmup_steps + s.decay_steps > training_steps) {
      log::warn("warmup (", s.warmup_steps, ") + decay (", s.decay_steps,
                ") steps exceed total training steps (", training_steps, "); using ",
                training_steps - s.warmup_steps, " decay steps");
      s.decay_steps = training_steps - s.warmup_steps;
    }
  } else {
    s.decay_steps = training_steps - s.warmup_steps;
  }
  s.stable_steps = training_steps + 1 - s.warmup_steps - s.decay_steps;
  return s;
}

double WarmupStableDecaySchedule::factor(int64_t step) const {
  if (step < warmup_steps) {
    return static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  const int64_t warmup_stable = warmup_steps + stable_steps;
  if (step < warmup_stable) return 1.0;
  // Beyond the run (or with no decay phase) the schedule holds its final value.
  const double progress =
      decay_steps == 0
          ? 1.0
          : std::min(1.0, static_cast<double>(step + 1 - warmup_stable) / static_cast<double>(decay_steps));
  double adjustment = 0.0;
  switch (decay_type) {
    case DecayType::kLinear: adjustment = 1.0 - progress; break;
    case DecayType::kSqrt: adjustment = 1.0 - std::sqrt(progress); break;
    case DecayType::kCosine: adjustment = 0.5 * (1.0 + std::cos(M_PI * progress)); break;
  }
  return min_lr_factor + (1.0 - min_lr_factor) * adjustment;
}

LRScheduler::LRScheduler(Optimizer& optimizer, const LRScheduleOptions& options,
                         int64_t training_steps)
    : optimizer_(optimizer),
      base_lr_(optimizer.lr()),
      schedule_(WarmupStableDecaySchedule::make(options, training_steps)) {
  optimizer_.set_lr(lr());
}

void LRScheduler::step() {
  ++last_step_;
  optimizer_.set_lr(lr());
}

TensorDict LRScheduler::state_dict() const {
  return {{"last_step", at::scalar_tensor(last_step_, at::kLong)}};
}

void LRScheduler::load_state_dict(const TensorDict& state) {
  auto it = state.find("last_step");
  LOOM_REQUIRE(it != state.end() && it->second.defined() && it->second.numel() == 1,
               "lr scheduler checkpoint has no scalar 'last_step' entry");
  LOOM_REQUIRE(state.size() == 1, "lr scheduler checkpoint has ", state.size(),
               " entries; expected only 'last_step'");
  const int64_t step = it->second.item<int64_t>();
  LOOM_REQUIRE(step >= 0, "lr scheduler checkpoint has negative last_step ", step);
  last_step_ = step;
  optimizer_.set_lr(lr());
}

}  // namespace loom::optim
