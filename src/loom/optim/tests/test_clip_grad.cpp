#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "loom/optim/clip_grad.h"

namespace loom::optim {
namespace {

std::vector<torch::Tensor> random_gradients(uint64_t seed, double scale) {
  torch::manual_seed(seed);
  return {torch::randn({32, 16}) * scale, torch::randn({16}) * scale, torch::randn({7, 3}) * scale};
}

double manual_norm(const std::vector<torch::Tensor>& grads) {
  double sum = 0.0;
  for (const auto& g : grads) sum += g.to(torch::kDouble).square().sum().item<double>();
  return std::sqrt(sum);
}

TEST(ClipGrad, ScalesDownLargeGradientsToMaxNorm) {
  std::vector<torch::Tensor> grads = random_gradients(1, 3.0);
  std::vector<torch::Tensor> original;
  for (const auto& g : grads) original.push_back(g.clone());
  const double expected = manual_norm(grads);
  ASSERT_GT(expected, 1.0);
  const torch::Tensor norm = clip_grad_norm_(grads, 1.0);
  EXPECT_NEAR(norm.item<double>(), expected, 1e-5 * expected);
  const double coef = 1.0 / (norm.item<double>() + 1e-6);
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_TRUE(torch::allclose(grads[i], original[i] * coef, 1e-6, 1e-7));
  }
  EXPECT_NEAR(manual_norm(grads), 1.0, 1e-5);
}

TEST(ClipGrad, LeavesSmallGradientsUnchanged) {
  std::vector<torch::Tensor> grads = random_gradients(2, 1e-3);
  std::vector<torch::Tensor> original;
  for (const auto& g : grads) original.push_back(g.clone());
  const torch::Tensor norm = clip_grad_norm_(grads, 1.0);
  EXPECT_NEAR(norm.item<double>(), manual_norm(original), 1e-9);
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(torch::equal(grads[i], original[i]));
}

TEST(ClipGrad, ReduceHookCombinesShardedGradients) {
  // Two "ranks" each hold half of every gradient; the hook sums their squared partial norms.
  const std::vector<torch::Tensor> full = random_gradients(3, 2.0);
  std::vector<torch::Tensor> rank0, rank1;
  for (const auto& g : full) {
    const torch::Tensor flat = g.flatten();
    const int64_t half = flat.numel() / 2;
    rank0.push_back(flat.slice(0, 0, half).clone());
    rank1.push_back(flat.slice(0, half).clone());
  }
  const double other_rank_sum_sq = std::pow(total_grad_norm(rank1).item<double>(), 2);
  int calls = 0;
  const SquaredNormReduceHook all_reduce = [&](torch::Tensor& sum_sq) {
    ++calls;
    sum_sq.add_(other_rank_sum_sq);
  };
  const torch::Tensor norm = clip_grad_norm_(rank0, 0.5, all_reduce);
  EXPECT_EQ(calls, 1);
  EXPECT_NEAR(norm.item<double>(), manual_norm(full), 1e-5 * manual_norm(full));
  // Both halves get the same global coefficient, so the full gradient ends at norm max_norm.
  clip_grads_with_norm_(rank1, 0.5, norm);
  EXPECT_NEAR(std::sqrt(std::pow(manual_norm(rank0), 2) + std::pow(manual_norm(rank1), 2)), 0.5,
              1e-5);

  // A rank without gradients still joins the collective.
  calls = 0;
  const SquaredNormReduceHook join = [&](torch::Tensor& sum_sq) {
    ++calls;
    EXPECT_EQ(sum_sq.item<double>(), 0.0);
    sum_sq.fill_(9.0);
  };
  EXPECT_DOUBLE_EQ(total_grad_norm({}, join).item<double>(), 3.0);
  EXPECT_EQ(calls, 1);
}

TEST(ClipGrad, NonFiniteNormStillScalesLikePyTorch) {
  std::vector<torch::Tensor> grads = {torch::tensor({1.0f, std::numeric_limits<float>::infinity()}),
                                      torch::tensor({2.0f, -3.0f})};
  const torch::Tensor norm = clip_grad_norm_(grads, 1.0);
  EXPECT_TRUE(std::isinf(norm.item<double>()));
  // coefficient = 1 / inf = 0: finite entries become 0, the infinite one 0 * inf = NaN.
  EXPECT_EQ(grads[1].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(grads[0][0].item<double>(), 0.0);
  EXPECT_TRUE(std::isnan(grads[0][1].item<double>()));

  std::vector<torch::Tensor> nan_grads = {torch::tensor({1.0f, std::nanf("")}),
                                          torch::tensor({2.0f})};
  EXPECT_TRUE(std::isnan(clip_grad_norm_(nan_grads, 1.0).item<double>()));
  EXPECT_TRUE(std::isnan(nan_grads[1].item<double>()));
}

TEST(ClipGrad, MixedDtypesAndUndefinedEntries) {
  torch::manual_seed(4);
  const torch::Tensor a = torch::randn({64});
  const torch::Tensor b = torch::randn({32}).to(torch::kBFloat16);
  std::vector<torch::Tensor> grads = {a.clone(), torch::Tensor(), b.clone()};
  const double expected = std::sqrt(a.to(torch::kDouble).square().sum().item<double>() +
                                    b.to(torch::kDouble).square().sum().item<double>());
  const torch::Tensor norm = clip_grad_norm_(grads, 1.0);
  EXPECT_EQ(norm.scalar_type(), torch::kFloat);
  EXPECT_NEAR(norm.item<double>(), expected, 1e-5 * expected);
  EXPECT_EQ(grads[2].scalar_type(), torch::kBFloat16);
  EXPECT_NEAR(manual_norm({grads[0], grads[2]}), 1.0, 1e-2);  // bf16 rounding
  EXPECT_THROW(clip_grad_norm_(grads, 0.0), std::exception);
}

}  // namespace
}  // namespace loom::optim
