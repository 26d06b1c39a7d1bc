// The MoE layer on a CUDA device reads nothing back to the host (issue 49: "no host read of the
// counts"): routing, the per-expert counts, the grouped GEMMs' offsets, the biases' gather, the
// combine and the backward all stay on the device, so a training step never waits for the GPU
// inside a layer. CUDA's sync debug mode in "error" turns any synchronising call (a device-to-host
// copy, .item(), a blocking host-to-device copy) into an exception; the forward and backward run
// under it. Then the balancing step (selection-bias update) and its metrics, whose host read is
// deferred to log steps. Without a CUDA device each test skips ("skipped: no CUDA device").
#include <gtest/gtest.h>

#include <torch/cuda.h>
#include <torch/torch.h>

#ifdef LOOM_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "loom/moe/moe.h"

namespace {

#define LOOM_REQUIRE_CUDA_DEVICE()                                                 \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device"

#ifdef LOOM_WITH_CUDA_KERNELS
// Sync debug mode "error" for the scope (torch.cuda.set_sync_debug_mode("error")).
struct NoHostSync {
  NoHostSync() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR); }
  ~NoHostSync() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED); }
};

loom::moe::MoEOptions moe_options(bool gpt_oss_experts) {
  loom::moe::MoEOptions o;
  o.router.n_experts = 16;
  o.router.top_k = 4;
  o.hidden_dim = 128;
  o.load_balance_coeff = 1e-3;
  if (gpt_oss_experts) {
    // GPT-OSS's experts: biases and the clamped SwiGLU, softmax over the chosen logits.
    o.experts.bias = true;
    o.experts.activation = loom::moe::ExpertActivation::kClampedSwiGLU;
    o.router.score_function = loom::moe::ScoreFunction::kSoftmaxAfterTopK;
  } else {
    o.shared_hidden_dim = 128;
  }
  return o;
}

void run_without_host_reads(bool gpt_oss_experts) {
  torch::manual_seed(0);
  const auto options = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  loom::moe::MoE moe(256, moe_options(gpt_oss_experts), options);
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : moe.named_parameters()) p.slot->tensor.normal_(0.0, 0.02);
  }
  ASSERT_TRUE(loom::moe::GroupedExperts::grouped_mm_supported(torch::zeros({1, 256}, options), moe.experts().w1()));
  const torch::Tensor x = torch::randn({2, 64, 256}, options).requires_grad_(true);
  // One step outside the guard: the first use of cuBLAS and the caching allocator may wait.
  moe.forward(x).to(torch::kFloat).square().sum().backward();
  torch::cuda::synchronize();
  torch::Tensor y;
  {
    NoHostSync guard;
    y = moe.forward(x);
    y.to(torch::kFloat).square().sum().backward();
    moe.balance_experts(moe.tokens_per_expert().clone());
  }
  torch::cuda::synchronize();
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(moe.experts().w1().grad()).all().item<bool>());
  EXPECT_GT(moe.expert_bias().abs().sum().item<double>(), 0.0);  // the balancing step moved it
}
#endif

}  // namespace

TEST(CudaMoE, ForwardBackwardAndBalancingReadNothingOnTheHost) {
  LOOM_REQUIRE_CUDA_DEVICE();
#ifdef LOOM_WITH_CUDA_KERNELS
  run_without_host_reads(/*gpt_oss_experts=*/false);
#else
  FAIL() << "a CUDA device is visible but this build has no CUDA (LOOM_WITH_CUDA_KERNELS unset)";
#endif
}

TEST(CudaMoE, GptOssExpertsWithBiasesReadNothingOnTheHost) {
  LOOM_REQUIRE_CUDA_DEVICE();
#ifdef LOOM_WITH_CUDA_KERNELS
  run_without_host_reads(/*gpt_oss_experts=*/true);
#else
  FAIL() << "a CUDA device is visible but this build has no CUDA (LOOM_WITH_CUDA_KERNELS unset)";
#endif
}
