// The CUDA fused classifier (nn/cuda/cross_entropy.cu through fused_linear_cross_entropy's kCuda
// path) against the ATen composition: logits = hidden @ weight^T, cross_entropy, autograd.
//
// Tolerances: fp32 inputs 1e-4 relative on the loss and gradients (the kernel's exp/log are the fast
// hardware approximations, ~2 ulp); bf16 autocast 2e-2 relative on the gradients' norms of the
// difference (bf16 dlogits and bf16 GEMM products, like the composition's own bf16 rounding) and
// 5e-3 absolute on the loss (fp32 softmax math on both sides; bf16 logits).
#include <gtest/gtest.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/nn/fused.h"

namespace cuda_cross_entropy_test {

using loom::nn::FusedImpl;
using loom::nn::fused_linear_cross_entropy;

struct Result {
  torch::Tensor loss, grad_hidden, grad_weight;
};

Result run(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& labels,
           std::optional<FusedImpl> impl, bool autocast) {
  torch::Tensor h = hidden.detach().clone().requires_grad_(true);
  torch::Tensor w = weight.detach().clone().requires_grad_(true);
  torch::Tensor loss;
  {
    at::autocast::set_autocast_enabled(at::kCUDA, autocast);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    if (impl) {
      loss = fused_linear_cross_entropy(h, w, labels, -100, 512, impl);
    } else {
      const torch::Tensor logits = torch::nn::functional::linear(h, w).to(torch::kFloat32);
      loss = torch::nn::functional::cross_entropy(logits, labels);
    }
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
  }
  loss.backward();
  return {loss.detach(), h.grad(), w.grad()};
}

double relative(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kFloat64) - b.to(torch::kFloat64)).norm() /
          b.to(torch::kFloat64).norm().clamp_min(1e-30))
      .item<double>();
}

#ifdef LOOM_WITH_CUDA_KERNELS
void expect_matches(int64_t tokens, int64_t vocab, int64_t dim, torch::ScalarType dtype,
                    bool autocast, double loss_tol, double grad_tol) {
  torch::manual_seed(0);
  const auto on = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor hidden = torch::randn({tokens, dim}, on.dtype(dtype));
  const torch::Tensor weight = (torch::randn({vocab, dim}, on) * 0.2).to(dtype);
  torch::Tensor labels = torch::randint(0, vocab, {tokens}, on.dtype(torch::kLong));
  labels.index_put_({torch::arange(0, tokens, 7, on.dtype(torch::kLong))}, -100);  // ignored rows
  const Result cuda = run(hidden, weight, labels, FusedImpl::kCuda, autocast);
  const Result ref = run(hidden, weight, labels, std::nullopt, autocast);
  EXPECT_NEAR(cuda.loss.item<double>(), ref.loss.item<double>(), loss_tol)
      << tokens << "x" << vocab << " " << dtype;
  EXPECT_LT(relative(cuda.grad_hidden, ref.grad_hidden), grad_tol) << tokens << "x" << vocab;
  EXPECT_LT(relative(cuda.grad_weight, ref.grad_weight), grad_tol) << tokens << "x" << vocab;
  EXPECT_EQ(cuda.grad_hidden.scalar_type(), hidden.scalar_type());
  EXPECT_EQ(cuda.grad_weight.scalar_type(), weight.scalar_type());
}
#endif

TEST(CudaCrossEntropy, Fp32MatchesLinearPlusCrossEntropyOverSeveralChunks) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (this libtorch has no CUDA kernels built)";
#else
  // 5000 tokens: more than the 4096-row chunk cap, so two chunks, the second ragged. Vocab 1000 is
  // not a multiple of the 16-byte pack (scalar path); 1024 is (vector path).
  expect_matches(5000, 1000, 64, torch::kFloat32, false, 1e-4, 1e-4);
  expect_matches(5000, 1024, 64, torch::kFloat32, false, 1e-4, 1e-4);
#endif
}

TEST(CudaCrossEntropy, Bf16AutocastWithFp32MasterWeightMatchesTheComposition) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (this libtorch has no CUDA kernels built)";
#else
  expect_matches(4500, 2048, 128, torch::kFloat32, true, 5e-3, 2e-2);
  expect_matches(300, 1000, 64, torch::kBFloat16, false, 5e-3, 2e-2);
#endif
}

TEST(CudaCrossEntropy, MatchesTheGenericPathAndFlagsBadLabelsWithoutSyncing) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (this libtorch has no CUDA kernels built)";
#else
  torch::manual_seed(1);
  const auto on = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor hidden = torch::randn({257, 32}, on);
  const torch::Tensor weight = torch::randn({300, 32}, on) * 0.3;
  const torch::Tensor labels = torch::randint(0, 300, {257}, on.dtype(torch::kLong));
  const Result cuda = run(hidden, weight, labels, FusedImpl::kCuda, false);
  const Result generic = run(hidden, weight, labels, FusedImpl::kGeneric, false);
  EXPECT_NEAR(cuda.loss.item<double>(), generic.loss.item<double>(), 1e-4);
  EXPECT_LT(relative(cuda.grad_hidden, generic.grad_hidden), 1e-4);
  EXPECT_LT(relative(cuda.grad_weight, generic.grad_weight), 1e-4);

  // Every label ignored: nan loss and zero gradients, as PyTorch's mean over no tokens.
  const torch::Tensor ignored = torch::full({257}, -100, on.dtype(torch::kLong));
  const Result none = run(hidden, weight, ignored, FusedImpl::kCuda, false);
  EXPECT_TRUE(std::isnan(none.loss.item<double>()));
  EXPECT_EQ(none.grad_hidden.abs().max().item<double>(), 0.0);
  EXPECT_EQ(none.grad_weight.abs().max().item<double>(), 0.0);

  // A label outside the vocabulary: no device assert, no out-of-bounds read; the loss is nan, on
  // both device paths.
  torch::Tensor bad = labels.clone();
  bad.index_put_({5}, 300);
  EXPECT_TRUE(std::isnan(run(hidden, weight, bad, FusedImpl::kCuda, false).loss.item<double>()));
  EXPECT_TRUE(std::isnan(run(hidden, weight, bad, FusedImpl::kGeneric, false).loss.item<double>()));
  torch::cuda::synchronize();  // the context is healthy afterwards
#endif
}

TEST(CudaCrossEntropy, SwitchedOffKernelFallsBackToTheComposition) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (this libtorch has no CUDA kernels built)";
#else
  using loom::nn::CudaKernelSet;
  const auto on = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor hidden = torch::randn({64, 16}, on);
  const torch::Tensor weight = torch::randn({50, 16}, on);
  const torch::Tensor labels = torch::randint(0, 50, {64}, on.dtype(torch::kLong));
  loom::nn::set_cuda_kernels(loom::nn::parse_cuda_kernels("swiglu,rope"));
  // The composition as reference; the automatic choice below runs the generic path, and a forced
  // kCuda is an error.
  const Result automatic = run(hidden, weight, labels, std::nullopt, false);
  EXPECT_THROW(fused_linear_cross_entropy(hidden, weight, labels, -100, 512, FusedImpl::kCuda),
               loom::Error);
  const torch::Tensor loss = fused_linear_cross_entropy(hidden, weight, labels);
  EXPECT_NEAR(loss.item<double>(), automatic.loss.item<double>(), 1e-5);
  loom::nn::set_cuda_kernels(CudaKernelSet::all());
#endif
}

}  // namespace cuda_cross_entropy_test
