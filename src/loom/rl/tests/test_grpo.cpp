// GRPO's advantages and objective (rl/grpo.h) against the formulas written out token by token in
// float64 (TRL's GRPOTrainer's maths): every aggregation, clipping on both sides engaged, the k3 KL,
// the gradient in logp, and the degenerate cases (a group of equal rewards, padding).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "loom/core/error.h"
#include "loom/rl/grpo.h"
#include "loom/testing/errors.h"

namespace {
using namespace loom::rl;

TEST(Grpo, AdvantagesAreGroupRelative) {
  const torch::Tensor rewards = torch::tensor({1.0, 0.0, 0.0, 1.0, /**/ 3.0, 3.0, 3.0, 3.0, /**/ 0.0, 2.0, 4.0, 6.0});
  const torch::Tensor a = group_advantages(rewards, 4);
  // Group 1: mean 0.5, unbiased std sqrt(1/3).
  const double s1 = std::sqrt(1.0 / 3.0);
  EXPECT_NEAR(a[0].item<double>(), 0.5 / (s1 + 1e-4), 1e-6);
  EXPECT_NEAR(a[1].item<double>(), -0.5 / (s1 + 1e-4), 1e-6);
  // Group 2: equal rewards, nothing to learn.
  EXPECT_EQ(a.narrow(0, 4, 4).abs().sum().item<double>(), 0.0);
  // Group 3: mean 3, unbiased std sqrt(20/3).
  EXPECT_NEAR(a[11].item<double>(), 3.0 / (std::sqrt(20.0 / 3.0) + 1e-4), 1e-5);
  // Dr. GRPO: centred only.
  const torch::Tensor c = group_advantages(rewards, 4, AdvantageScale::kNone);
  EXPECT_NEAR(c[11].item<double>(), 3.0, 1e-6);
  EXPECT_NEAR(c.view({3, 4}).sum(1).abs().max().item<double>(), 0.0, 1e-6);
  loom::testing::expect_error<loom::UsageError>([&] { group_advantages(rewards, 1); }, {"at least 2 completions"});
  loom::testing::expect_error<loom::UsageError>([&] { group_advantages(rewards, 5); }, {"not whole groups of 5"});
}

// The objective written out in float64, one token at a time.
double reference_loss(const torch::Tensor& logp, const torch::Tensor& old, const torch::Tensor& ref,
                      const torch::Tensor& adv, const torch::Tensor& mask, const GrpoOptions& o) {
  const int64_t b = logp.size(0), t = logp.size(1);
  double sequences = 0, total = 0, tokens = 0;
  for (int64_t i = 0; i < b; ++i) {
    double sum = 0, n = 0;
    for (int64_t j = 0; j < t; ++j) {
      if (mask[i][j].item<double>() == 0) continue;
      const double lp = logp[i][j].item<double>(), lo = old[i][j].item<double>();
      const double a = adv[i].item<double>();
      const double ratio = std::exp(lp - lo);
      const double clipped = std::min(std::max(ratio, 1 - o.clip_low), 1 + o.clip_high);
      double loss = -std::min(ratio * a, clipped * a);
      if (o.kl_beta > 0) {
        const double d = ref[i][j].item<double>() - lp;
        loss += o.kl_beta * (std::exp(d) - d - 1);
      }
      sum += loss, n += 1;
    }
    sequences += sum / n, total += sum, tokens += n;
  }
  switch (o.aggregation) {
    case LossAggregation::kSequenceMean: return sequences / static_cast<double>(b);
    case LossAggregation::kTokenMean: return total / tokens;
    case LossAggregation::kDrGrpo: return total / static_cast<double>(b * t);
  }
  return 0;
}

TEST(Grpo, LossAndGradientEqualTheFormulasInEveryAggregation) {
  torch::manual_seed(3);
  const int64_t b = 6, t = 9;
  const torch::Tensor old = -torch::rand({b, t}, torch::kFloat64) * 4;
  // Ratios from about e^-0.6 to e^0.6: clipping engages on both sides.
  const torch::Tensor base = old + (torch::rand({b, t}, torch::kFloat64) - 0.5) * 1.2;
  const torch::Tensor ref = old + (torch::rand({b, t}, torch::kFloat64) - 0.5);
  const torch::Tensor adv = torch::tensor({1.2, -0.7, 0.0, 2.0, -1.5, 0.4}, torch::kFloat64);
  torch::Tensor mask = torch::ones({b, t}, torch::kFloat64);
  mask[0].narrow(0, 5, 4).zero_();  // padded completions of different lengths
  mask[3].narrow(0, 2, 7).zero_();
  for (LossAggregation agg : {LossAggregation::kSequenceMean, LossAggregation::kTokenMean, LossAggregation::kDrGrpo}) {
    for (double beta : {0.0, 0.04}) {
      GrpoOptions o;
      o.aggregation = agg, o.kl_beta = beta, o.clip_high = 0.28;  // DAPO's clip-higher
      torch::Tensor logp = base.clone().requires_grad_(true);
      const GrpoLoss got = grpo_loss(logp, old, ref, adv, mask, o);
      EXPECT_NEAR(got.loss.item<double>(), reference_loss(base, old, ref, adv, mask, o), 1e-12);
      got.loss.backward();
      // The gradient against central differences of the written-out objective.
      const double h = 1e-6;
      double worst = 0;
      for (int64_t i = 0; i < b; ++i) {
        for (int64_t j = 0; j < t; ++j) {
          torch::Tensor plus = base.clone(), minus = base.clone();
          plus[i][j] += h, minus[i][j] -= h;
          const double numeric = (reference_loss(plus, old, ref, adv, mask, o) - reference_loss(minus, old, ref, adv, mask, o)) / (2 * h);
          worst = std::max(worst, std::abs(numeric - logp.grad()[i][j].item<double>()));
        }
      }
      EXPECT_LT(worst, 1e-7) << static_cast<int>(agg) << " beta " << beta;
      EXPECT_GT(got.clipped_low, 0.0);
      EXPECT_GT(got.clipped_high, 0.0);
      if (beta > 0) EXPECT_GT(got.kl, 0.0);
    }
  }
}

// One update per rollout: logp_old = logp, every ratio 1, the gradient of the sequence mean is
// -A / (tokens of the completion) / B on each of its tokens; padding gets none.
TEST(Grpo, OnPolicyGradientIsTheAdvantageAndPaddingGetsNone) {
  const torch::Tensor base = -torch::rand({2, 4}, torch::kFloat64);
  torch::Tensor logp = base.clone().requires_grad_(true);
  const torch::Tensor mask = torch::tensor({{1.0, 1.0, 1.0, 0.0}, {1.0, 1.0, 1.0, 1.0}}, torch::kFloat64);
  const torch::Tensor adv = torch::tensor({0.9, -0.3}, torch::kFloat64);
  const GrpoLoss got = grpo_loss(logp, logp.detach(), torch::Tensor(), adv, mask, GrpoOptions{});
  got.loss.backward();
  EXPECT_NEAR(logp.grad()[0][0].item<double>(), -0.9 / 3 / 2, 1e-12);
  EXPECT_NEAR(logp.grad()[1][3].item<double>(), 0.3 / 4 / 2, 1e-12);
  EXPECT_EQ(logp.grad()[0][3].item<double>(), 0.0);
  EXPECT_DOUBLE_EQ(got.ratio, 1.0);
  EXPECT_EQ(got.clipped_low + got.clipped_high, 0.0);
}

TEST(Grpo, BadInputIsOneLine) {
  const torch::Tensor x = torch::zeros({2, 3});
  GrpoOptions o;
  o.clip_low = 1.5;
  loom::testing::expect_error<loom::UsageError>([&] { o.validate(); }, {"clip_low must be in (0, 1)"});
  o = GrpoOptions{};
  o.kl_beta = 0.1;
  EXPECT_THROW(grpo_loss(x, x, torch::Tensor(), torch::zeros({2}), torch::ones({2, 3}), o), loom::Error);
  EXPECT_THROW(grpo_loss(x, x, x, torch::zeros({2}), torch::tensor({{1.0, 1.0, 1.0}, {0.0, 0.0, 0.0}}), GrpoOptions{}),
               loom::Error);
}

}  // namespace
