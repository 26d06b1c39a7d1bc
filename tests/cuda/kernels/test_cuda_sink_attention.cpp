// GPT-OSS's attention with sinks on CUDA (nn/attention.cpp, SinkAttentionFlashCUDA): in bf16, causal
// or unmasked, it runs CUDA's flash kernel and corrects its output and log-sum-exp for the sink, as
// the CPU path does with the CPU flash kernel, instead of the explicit float32 softmax that holds
// every [B, H, T, T] score. Checked against that explicit softmax on the same device, run in
// float32 on the same (bf16-rounded) values: output and the q, k, v and sink gradients, with
// grouped KV heads (4 query heads per KV head) and without. Tolerance: relative L2 error 2e-2
// (bf16 inputs and outputs, float32 accumulation in both). Without a CUDA device each test skips
// ("skipped: no CUDA device").
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <string>

#include "loom/nn/attention.h"

namespace sink_attention_cuda_test {

#define LOOM_REQUIRE_CUDA_DEVICE() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device"

struct Run {
  torch::Tensor out, dq, dk, dv, dsinks;
  std::string node;  // the autograd node that produced `out`
};

// q [B, H, T, D], k and v [B, KV, T, D], sinks [H]; the loss weights the output by `weight`.
Run run(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor sinks, const torch::Tensor& weight,
        bool causal) {
  q = q.detach().requires_grad_(true);
  k = k.detach().requires_grad_(true);
  v = v.detach().requires_grad_(true);
  sinks = sinks.detach().requires_grad_(true);
  const torch::Tensor out = loom::nn::sink_attention(q, k, v, std::nullopt, causal, sinks);
  (out.to(torch::kFloat32) * weight).sum().backward();
  return {out.detach().to(torch::kFloat32), q.grad().to(torch::kFloat32), k.grad().to(torch::kFloat32),
          v.grad().to(torch::kFloat32), sinks.grad().to(torch::kFloat32), out.grad_fn()->name()};
}

double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  return ((got - want).norm() / want.norm().clamp_min(1e-12)).item<double>();
}

void check(int64_t heads, int64_t kv_heads, bool causal) {
  torch::manual_seed(0);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const int64_t batch = 2, seq = 384, dim = 64;
  // bf16 values, so both runs see the same inputs and differ only in how they compute.
  const auto bf16 = [&](std::initializer_list<int64_t> shape) {
    return torch::randn(shape, cuda).to(torch::kBFloat16);
  };
  const torch::Tensor q = bf16({batch, heads, seq, dim}), k = bf16({batch, kv_heads, seq, dim}),
                      v = bf16({batch, kv_heads, seq, dim});
  const torch::Tensor sinks = torch::randn({heads}, cuda).to(torch::kBFloat16);
  const torch::Tensor weight = torch::randn({batch, heads, seq, dim}, cuda);

  const Run flash = run(q, k, v, sinks, weight, causal);
  const Run math = run(q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32),
                       sinks.to(torch::kFloat32), weight, causal);
  EXPECT_NE(flash.node.find("SinkAttentionFlashCUDA"), std::string::npos) << flash.node;
  EXPECT_EQ(math.node.find("SinkAttentionFlashCUDA"), std::string::npos) << math.node;  // float32: explicit softmax
  for (const auto& [what, got, want] :
       {std::tuple{"out", flash.out, math.out}, std::tuple{"dq", flash.dq, math.dq},
        std::tuple{"dk", flash.dk, math.dk}, std::tuple{"dv", flash.dv, math.dv},
        std::tuple{"dsinks", flash.dsinks, math.dsinks}}) {
    ASSERT_FALSE(got.isnan().any().item<bool>()) << what;
    EXPECT_LT(relative_error(got, want), 2e-2) << what << " (heads " << heads << ", kv " << kv_heads
                                               << (causal ? ", causal" : "") << ")";
  }
}

TEST(CudaSinkAttention, FlashMatchesTheExplicitSoftmaxCausal) {
  LOOM_REQUIRE_CUDA_DEVICE();
  check(8, 8, true);
}

TEST(CudaSinkAttention, FlashMatchesTheExplicitSoftmaxWithGroupedKvHeads) {
  LOOM_REQUIRE_CUDA_DEVICE();
  check(8, 2, true);
  check(8, 2, false);
}

// A mask (sliding windows, documents) or float32 keeps the explicit softmax.
TEST(CudaSinkAttention, MasksAndFloat32KeepTheExplicitSoftmax) {
  LOOM_REQUIRE_CUDA_DEVICE();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor q = torch::randn({1, 4, 16, 64}, cuda).to(torch::kBFloat16).requires_grad_(true);
  const torch::Tensor k = torch::randn({1, 4, 16, 64}, cuda).to(torch::kBFloat16);
  const torch::Tensor sinks = torch::zeros({4}, cuda).to(torch::kBFloat16);
  const torch::Tensor mask = torch::ones({16, 16}, cuda.dtype(torch::kBool)).tril();
  const torch::Tensor masked = loom::nn::sink_attention(q, k, k, mask, false, sinks);
  EXPECT_EQ(masked.grad_fn()->name().find("SinkAttentionFlashCUDA"), std::string::npos) << masked.grad_fn()->name();
  const torch::Tensor causal = loom::nn::sink_attention(q, k, k, std::nullopt, true, sinks);
  EXPECT_NE(causal.grad_fn()->name().find("SinkAttentionFlashCUDA"), std::string::npos) << causal.grad_fn()->name();
  // The same rows either way: the mask is the causal one.
  EXPECT_LT(relative_error(masked.to(torch::kFloat32), causal.to(torch::kFloat32)), 2e-2);
}

}  // namespace sink_attention_cuda_test
