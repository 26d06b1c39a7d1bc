#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/optim/adamw.h"
#include "loom/optim/lr_scheduler.h"

namespace loom::optim {
namespace {

WarmupStableDecaySchedule make(int64_t steps, int64_t warmup, std::optional<double> ratio,
                               DecayType type, double min_lr_factor) {
  return WarmupStableDecaySchedule::make(
      LRScheduleOptions{warmup, ratio, type, min_lr_factor}, steps);
}

TEST(LRSchedule, DecayAfterWarmupBoundariesForEachDecayType) {
  // 100 steps, 10 warmup, decay over the remaining 90 (+1 virtual stable step), floor 0.1.
  const double progress_last = 89.0 / 90.0;  // progress at the last training step (index 99)
  const std::map<DecayType, std::pair<double, double>> expected = {
      // {factor at step 11 (first decayed step), factor at step 99 (last training step)}
      {DecayType::kLinear, {0.1 + 0.9 * (1.0 - 1.0 / 90.0), 0.1 + 0.9 * (1.0 - progress_last)}},
      {DecayType::kSqrt,
       {0.1 + 0.9 * (1.0 - std::sqrt(1.0 / 90.0)), 0.1 + 0.9 * (1.0 - std::sqrt(progress_last))}},
      {DecayType::kCosine,
       {0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI / 90.0)),
        0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress_last))}},
  };
  for (const auto& [type, values] : expected) {
    SCOPED_TRACE(std::string(loom::options::enum_name(type)));
    const auto s = make(100, 10, std::nullopt, type, 0.1);
    EXPECT_EQ(s.warmup_steps, 10);
    EXPECT_EQ(s.decay_steps, 90);
    EXPECT_EQ(s.stable_steps, 1);
    EXPECT_DOUBLE_EQ(s.factor(0), 0.1);  // first step runs at lr / warmup_steps
    EXPECT_DOUBLE_EQ(s.factor(4), 0.5);
    EXPECT_DOUBLE_EQ(s.factor(9), 1.0);  // last warmup step reaches the peak
    EXPECT_DOUBLE_EQ(s.factor(10), 1.0);  // the virtual stable step
    EXPECT_DOUBLE_EQ(s.factor(11), values.first);
    EXPECT_DOUBLE_EQ(s.factor(99), values.second);
    EXPECT_GT(s.factor(99), 0.1);         // the last step is not at the floor yet
    EXPECT_DOUBLE_EQ(s.factor(100), 0.1);  // one past the end reaches min_lr_factor
    EXPECT_DOUBLE_EQ(s.factor(1000), 0.1);
  }
}

TEST(LRSchedule, WarmupStableDecayUsesTheLastRatioOfSteps) {
  const auto s = make(100, 10, 0.2, DecayType::kLinear, 0.0);
  EXPECT_EQ(s.decay_steps, 20);
  EXPECT_EQ(s.stable_steps, 71);
  EXPECT_DOUBLE_EQ(s.factor(50), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(80), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(81), 1.0 - 1.0 / 20.0);
  EXPECT_DOUBLE_EQ(s.factor(99), 1.0 - 19.0 / 20.0);
  EXPECT_DOUBLE_EQ(s.factor(100), 0.0);
}

TEST(LRSchedule, PhaseLengthsRoundAndClampLikeTorchTitan) {
  // round(10 * 0.25) = round(2.5) = 2 and round(30 * 0.05) = round(1.5) = 2: Python rounds to even.
  EXPECT_EQ(make(10, 0, 0.25, DecayType::kLinear, 0.0).decay_steps, 2);
  EXPECT_EQ(make(30, 0, 0.05, DecayType::kLinear, 0.0).decay_steps, 2);
  // Warmup + decay longer than the run: decay is shortened to what is left.
  const auto clamped = make(10, 8, 0.5, DecayType::kLinear, 0.0);
  EXPECT_EQ(clamped.decay_steps, 2);
  EXPECT_EQ(clamped.stable_steps, 1);
  // Warmup longer than the run: shortened to the run, no decay.
  const auto all_warmup = make(5, 50, std::nullopt, DecayType::kCosine, 0.0);
  EXPECT_EQ(all_warmup.warmup_steps, 5);
  EXPECT_EQ(all_warmup.decay_steps, 0);
  EXPECT_DOUBLE_EQ(all_warmup.factor(0), 0.2);
  EXPECT_DOUBLE_EQ(all_warmup.factor(4), 1.0);
  // No warmup: the first step already decays.
  const auto no_warmup = make(4, 0, std::nullopt, DecayType::kLinear, 0.0);
  EXPECT_DOUBLE_EQ(no_warmup.factor(0), 1.0);  // stable virtual step
  EXPECT_DOUBLE_EQ(no_warmup.factor(1), 0.75);
  EXPECT_DOUBLE_EQ(no_warmup.factor(3), 0.25);
}

TEST(LRSchedule, RejectsBadOptions) {
  EXPECT_THROW(make(100, 10, 1.5, DecayType::kLinear, 0.0), loom::UsageError);
  EXPECT_THROW(make(100, -1, std::nullopt, DecayType::kLinear, 0.0), loom::UsageError);
  EXPECT_THROW(make(100, 10, std::nullopt, DecayType::kLinear, 2.0), loom::UsageError);
  EXPECT_THROW(make(0, 10, std::nullopt, DecayType::kLinear, 0.0), loom::UsageError);
  EXPECT_EQ(loom::options::parse_enum<DecayType>("cosine", "lr_scheduler.decay_type"), DecayType::kCosine);
  try {
    loom::options::parse_enum<DecayType>("cos", "lr_scheduler.decay_type");
    FAIL() << "unknown decay type accepted";
  } catch (const loom::UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "lr_scheduler.decay_type must be \"linear\", \"sqrt\" or \"cosine\", got \"cos\" (did you mean \"cosine\"?)");
  }
}

TEST(LRScheduler, DrivesOptimizerLrAndResumesFromStateDict) {
  torch::Tensor w = torch::zeros({2});
  AdamW opt({single_param_group({{"w", w}}, 0.0)}, AdamWOptions{.lr = 8e-4});
  const LRScheduleOptions options{4, std::nullopt, DecayType::kCosine, 0.0};
  LRScheduler scheduler(opt, options, 20);
  EXPECT_DOUBLE_EQ(opt.lr(), 8e-4 * 0.25);  // step 1 runs at factor(0)
  for (int i = 0; i < 6; ++i) scheduler.step();
  EXPECT_EQ(scheduler.last_step(), 6);
  EXPECT_DOUBLE_EQ(opt.lr(), 8e-4 * scheduler.schedule().factor(6));

  AdamW opt2({single_param_group({{"w", torch::zeros({2})}}, 0.0)}, AdamWOptions{.lr = 8e-4});
  LRScheduler resumed(opt2, options, 20);
  resumed.load_state_dict(scheduler.state_dict());
  EXPECT_EQ(resumed.last_step(), 6);
  EXPECT_DOUBLE_EQ(opt2.lr(), opt.lr());
  scheduler.step();
  resumed.step();
  EXPECT_DOUBLE_EQ(opt2.lr(), opt.lr());
  EXPECT_THROW(resumed.load_state_dict({}), loom::Error);
}

}  // namespace
}  // namespace loom::optim
