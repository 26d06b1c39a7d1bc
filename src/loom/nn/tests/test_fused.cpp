// The fused kernels (loom/nn/fused.h) against the plain libtorch compositions they replace:
// forward values and the gradients of every input, fp32, with the tolerance stated per test.
#include <gtest/gtest.h>

#include "loom/core/error.h"
#include "loom/nn/fused.h"
#include "loom/nn/rope.h"
#include "loom/nn/tests/fused_test_support.h"

namespace {
using loom::nn::test_support::CEResult;
using loom::nn::test_support::expect_close;
using loom::nn::test_support::run_ce;
using namespace loom::nn;


// Runs `f` on fresh leaf copies of `inputs`, backpropagates `upstream`, returns output and grads.
template <typename F>
std::pair<torch::Tensor, std::vector<torch::Tensor>> run(F f, const std::vector<torch::Tensor>& inputs,
                                                         const torch::Tensor& upstream) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(true));
  torch::Tensor out = f(leaves);
  (out * upstream).sum().backward();
  std::vector<torch::Tensor> grads;
  for (const auto& l : leaves) grads.push_back(l.grad());
  return {out.detach(), grads};
}

TEST(FusedRMSNorm, MatchesAtenRmsNormForwardAndBackward) {
  // fp32, rtol 1e-5 / atol 1e-6 (the weight gradient sums 60 rows: atol 1e-5).
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({3, 20, 96}) * 3;
  const torch::Tensor w = torch::randn({96});
  const torch::Tensor up = torch::randn({3, 20, 96});
  auto [y, g] = run([](auto& in) { return fused_rms_norm(in[0], in[1], 1e-5); }, {x, w}, up);
  auto [y_ref, g_ref] = run([](auto& in) { return at::rms_norm(in[0], {96}, in[1], 1e-5); }, {x, w}, up);
  expect_close(y, y_ref, 1e-5, 1e-6, "y");
  expect_close(g[0], g_ref[0], 1e-5, 1e-6, "dx");
  expect_close(g[1], g_ref[1], 1e-5, 1e-5, "dweight");
}

TEST(FusedRMSNorm, NonContiguousInputAndFrozenWeight) {
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({40, 2, 64}).transpose(0, 1);  // [2, 40, 64], strided
  torch::Tensor xl = x.detach().clone().requires_grad_(true);
  const torch::Tensor w = torch::rand({64}) + 0.5;  // no grad
  fused_rms_norm(xl, w, 1e-6).sum().backward();
  torch::Tensor xr = x.detach().clone().requires_grad_(true);
  at::rms_norm(xr, {64}, w, 1e-6).sum().backward();
  expect_close(xl.grad(), xr.grad(), 1e-5, 1e-6, "dx");
}

TEST(FusedRMSNorm, OtherDtypesFallBackToAten) {
  const torch::Tensor x = torch::randn({4, 32}, torch::kFloat64);
  const torch::Tensor w = torch::randn({32}, torch::kFloat64);
  EXPECT_TRUE(torch::equal(fused_rms_norm(x, w, 1e-5), at::rms_norm(x, {32}, w, 1e-5)));
}

torch::Tensor rotary_reference(const torch::Tensor& x, const torch::Tensor& cache) {
  const int64_t t = x.size(1), half = x.size(3) / 2;
  const torch::Tensor cos = cache[0].narrow(0, 0, t).unsqueeze(1);
  const torch::Tensor sin = cache[1].narrow(0, 0, t).unsqueeze(1);
  return x * cos + torch::cat({x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * sin;
}

TEST(FusedRotary, MatchesCompositeForwardAndBackward) {
  // fp32, rtol 1e-5 / atol 1e-6. Cache longer than the sequence, as in the model.
  torch::manual_seed(2);
  const torch::Tensor cache = rope_cache(rope_inverse_frequencies(32, 500000.0, std::nullopt), 50);
  const torch::Tensor x = torch::randn({2, 17, 3, 32});
  const torch::Tensor up = torch::randn({2, 17, 3, 32});
  auto f = [&](auto& in) { return fused_rotary_embedding(in[0], cache); };
  auto r = [&](auto& in) { return rotary_reference(in[0], cache); };
  auto [y, g] = run(f, {x}, up);
  auto [y_ref, g_ref] = run(r, {x}, up);
  expect_close(y, y_ref, 1e-5, 1e-6, "y");
  expect_close(g[0], g_ref[0], 1e-5, 1e-6, "dx");
  // apply_rotary_embedding (the layer's entry point) takes the same kernel.
  expect_close(apply_rotary_embedding(x, cache), y_ref, 1e-5, 1e-6, "apply_rotary_embedding");
}

TEST(FusedSwiGLU, MatchesSiluTimesUpForwardAndBackward) {
  // fp32, rtol 1e-5 / atol 1e-6, over gate values from -100 to 100 (exp's clamped range).
  torch::manual_seed(3);
  torch::Tensor gate = torch::randn({5, 333}) * 4;
  gate[0][0] = -100.0;
  gate[0][1] = 100.0;
  gate[0][2] = 0.0;
  const torch::Tensor up_in = torch::randn({5, 333});
  const torch::Tensor up = torch::randn({5, 333});
  auto [y, g] = run([](auto& in) { return fused_swiglu(in[0], in[1]); }, {gate, up_in}, up);
  auto [y_ref, g_ref] = run([](auto& in) { return at::silu(in[0]) * in[1]; }, {gate, up_in}, up);
  expect_close(y, y_ref, 1e-5, 1e-6, "y");
  expect_close(g[0], g_ref[0], 1e-5, 1e-6, "d_gate");
  expect_close(g[1], g_ref[1], 1e-5, 1e-6, "d_up");
}



TEST(FusedLinearCrossEntropy, MatchesLinearPlusCrossEntropyWithIgnoredTokensAndRaggedChunks) {
  // fp32: loss rtol 1e-5; gradients rtol 1e-4 / atol 1e-7 (they are O(1/N)). 37 tokens in chunks
  // of 8 (the last one short), 3 ignored, logits spread wide (|logit| up to ~60), and the loss
  // scaled by 0.5 before backward (as gradient accumulation does).
  torch::manual_seed(4);
  const torch::Tensor hidden = torch::randn({37, 48}) * 4;
  const torch::Tensor weight = torch::randn({300, 48}) * 0.5;
  torch::Tensor labels = torch::randint(0, 300, {37}, torch::kInt64);
  labels[3] = -100;
  labels[17] = -100;
  labels[36] = -100;
  auto fused = [&](const torch::Tensor& h, const torch::Tensor& w) {
    return fused_linear_cross_entropy(h, w, labels, -100, /*chunk_tokens=*/8);
  };
  auto reference = [&](const torch::Tensor& h, const torch::Tensor& w) {
    return torch::nn::functional::cross_entropy(at::linear(h, w), labels);
  };
  const CEResult a = run_ce(fused, hidden, weight, 0.5);
  const CEResult b = run_ce(reference, hidden, weight, 0.5);
  expect_close(a.loss, b.loss, 1e-5, 0.0, "loss");
  expect_close(a.d_hidden, b.d_hidden, 1e-4, 1e-7, "d_hidden");
  expect_close(a.d_weight, b.d_weight, 1e-4, 1e-7, "d_weight");
}

TEST(FusedLinearCrossEntropy, ForwardOnlyUnderNoGradAndFrozenWeight) {
  torch::manual_seed(5);
  const torch::Tensor hidden = torch::randn({10, 16});
  const torch::Tensor weight = torch::randn({50, 16});
  const torch::Tensor labels = torch::randint(0, 50, {10}, torch::kInt64);
  const torch::Tensor ref = torch::nn::functional::cross_entropy(at::linear(hidden, weight), labels);
  {
    torch::NoGradGuard no_grad;
    expect_close(fused_linear_cross_entropy(hidden, weight, labels), ref, 1e-5, 0.0, "no-grad loss");
  }
  torch::Tensor h = hidden.clone().requires_grad_(true);
  fused_linear_cross_entropy(h, weight, labels, -100, 4).backward();
  torch::Tensor hr = hidden.clone().requires_grad_(true);
  torch::nn::functional::cross_entropy(at::linear(hr, weight), labels).backward();
  expect_close(h.grad(), hr.grad(), 1e-4, 1e-7, "d_hidden");
}

TEST(FusedLinearCrossEntropy, LabelOutsideVocabularyIsOneLineError) {
  const torch::Tensor hidden = torch::randn({4, 8});
  const torch::Tensor weight = torch::randn({10, 8});
  const torch::Tensor labels = torch::tensor({1, 2, 10, 3}, torch::kInt64);
  try {
    fused_linear_cross_entropy(hidden, weight, labels);
    FAIL() << "expected loom::Error";
  } catch (const loom::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("label 10"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.vocab_size"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

}  // namespace
