// GPT-OSS's MoE options of the shared layer against plain references written with torch ops:
// the router with a biased gate and the softmax over the k selected logits (after top-k), the
// experts with per-expert biases and the clamped SwiGLU (inputs large enough that both clamps
// engage, counted), forward and every gradient (input, router weight and bias, w1..w3, b1..b3) in
// float32 within 1e-5 of the largest value (+1), on the grouped GEMM and on the per-expert loop;
// experts without tokens and a call without tokens; and the mapping of transformers' interleaved
// gate_up_proj to Loom's w1/w3 and back.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/moe/moe.h"
#include "loom/testing/errors.h"

namespace moe_gpt_oss_tests {

using loom::moe::ExpertActivation;
using loom::moe::ExpertsOptions;
using loom::moe::MoE;
using loom::moe::MoEOptions;
using loom::moe::ScoreFunction;

constexpr double kAlpha = 1.702, kLimit = 7.0;

MoEOptions gpt_oss_options(int64_t n_experts, int64_t top_k, int64_t hidden) {
  MoEOptions o;
  o.router.n_experts = n_experts;
  o.router.top_k = top_k;
  o.router.score_function = ScoreFunction::kSoftmaxAfterTopK;
  o.router.gate_bias = true;
  o.hidden_dim = hidden;
  o.experts.bias = true;
  o.experts.activation = ExpertActivation::kClampedSwiGLU;
  o.experts.swiglu_alpha = kAlpha;
  o.experts.swiglu_limit = kLimit;
  return o;
}

// How many gate values the clamp cut (above the limit) and up values (outside +-limit) the
// reference saw: the test's inputs must engage both.
struct ClampCounts {
  int64_t gate = 0, up = 0, total = 0;
};

// The layer, written out: per token, logits = W x + b, the top k of them, a softmax over those k,
// and for each chosen expert e: g = w1[e] x + b1[e], u = w3[e] x + b3[e], clamped, the GLU, then
// w2[e] h + b2[e], times the token's weight for e, summed.
torch::Tensor reference_layer(MoE& moe, const torch::Tensor& x, ClampCounts* clamps) {
  const torch::Tensor tokens = x.reshape({-1, x.size(-1)});
  auto& ex = moe.experts();
  const torch::Tensor w = moe.router().gate().weight(), b = moe.router().gate().parameter("bias");
  const int64_t k = moe.options().router.top_k;
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < tokens.size(0); ++t) {
    const torch::Tensor xt = tokens[t];
    const torch::Tensor logits = at::matmul(w, xt) + b;
    const auto [top, idx] = logits.topk(k);
    const torch::Tensor weights = top.softmax(0);
    torch::Tensor acc = torch::zeros({x.size(-1)});
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = idx[j].item<int64_t>();
      torch::Tensor g = at::matmul(ex.w1()[e], xt) + ex.b1()[e];
      torch::Tensor u = at::matmul(ex.w3()[e], xt) + ex.b3()[e];
      if (clamps != nullptr) {
        clamps->gate += (g > kLimit).sum().item<int64_t>();
        clamps->up += (u.abs() > kLimit).sum().item<int64_t>();
        clamps->total += g.numel();
      }
      g = torch::clamp(g, c10::nullopt, kLimit);
      u = torch::clamp(u, -kLimit, kLimit);
      const torch::Tensor h = (u + 1) * (g * torch::sigmoid(kAlpha * g));
      acc = acc + weights[j] * (at::matmul(ex.w2()[e], h) + ex.b2()[e]);
    }
    rows.push_back(acc);
  }
  return torch::stack(rows).view(x.sizes());
}

// Weights large enough that the projections reach past the limit on a good share of the rows.
void init(MoE& moe, double std) {
  torch::NoGradGuard no_grad;
  for (auto& p : moe.named_parameters()) p.slot->tensor.normal_(0, std);
}

std::map<std::string, torch::Tensor> run(MoE& moe, const torch::Tensor& x, bool reference, ClampCounts* clamps = nullptr) {
  for (auto& p : moe.named_parameters()) p.slot->tensor.mutable_grad() = torch::Tensor();
  torch::Tensor xi = x.detach().clone().requires_grad_(true);
  const torch::Tensor y = reference ? reference_layer(moe, xi, clamps) : moe.forward(xi);
  (y * torch::linspace(-1, 1, y.numel()).view(y.sizes())).sum().backward();
  std::map<std::string, torch::Tensor> g{{"input", xi.grad()}, {"output", y.detach()}};
  for (auto& p : moe.named_parameters()) g[p.name] = p.slot->tensor.grad();
  return g;
}

// Worst |got - want| / (1 + max |want|) over the output and every gradient; fails above 1e-5.
double expect_matches_reference(MoE& moe, const torch::Tensor& x, ClampCounts* clamps) {
  const auto got = run(moe, x, false);
  const auto want = run(moe, x, true, clamps);
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (const auto& [name, w] : want) {
    EXPECT_TRUE(w.defined()) << name;
    EXPECT_TRUE(got.at(name).defined()) << name;
    if (!w.defined() || !got.at(name).defined()) continue;
    const double d = (got.at(name) - w).abs().max().item<double>() / (1 + w.abs().max().item<double>());
    EXPECT_LE(d, 1e-5) << name;
    worst = std::max(worst, d);
  }
  return worst;
}

TEST(GptOssRouter, TopKOfBiasedLogitsThenSoftmaxOverThem) {
  torch::manual_seed(10);
  const loom::moe::RouterOptions o{.n_experts = 8, .top_k = 4, .score_function = ScoreFunction::kSoftmaxAfterTopK};
  const torch::Tensor logits = torch::randn({32, 8}) * 3;
  const loom::moe::Routing r = loom::moe::route(logits, o);
  const auto [top, idx] = logits.topk(4);
  EXPECT_TRUE(torch::equal(r.experts, idx));
  EXPECT_LE((r.weights - top.softmax(-1)).abs().max().item<double>(), 1e-7);
  // Without a selection bias it equals softmax over all, renormalised over the chosen (TorchTitan's
  // GPT-OSS router): the same experts, weights equal up to rounding.
  const loom::moe::Routing renorm =
      loom::moe::route(logits, {.n_experts = 8, .top_k = 4, .score_function = ScoreFunction::kSoftmax, .normalize = true});
  EXPECT_TRUE(torch::equal(renorm.experts, r.experts));
  EXPECT_LE((renorm.weights - r.weights).abs().max().item<double>(), 1e-6);
  EXPECT_EQ(loom::options::enum_name(ScoreFunction::kSoftmaxAfterTopK), "softmax_topk");
  // The gate's bias is a parameter of the router ("gate.bias") only when asked for.
  loom::moe::Router with(16, {.n_experts = 8, .top_k = 2, .gate_bias = true}, torch::TensorOptions());
  loom::moe::Router without(16, {.n_experts = 8, .top_k = 2}, torch::TensorOptions());
  EXPECT_TRUE(with.gate().has_bias());
  EXPECT_FALSE(without.gate().has_bias());
}

TEST(GptOssMoE, OutputsAndGradientsMatchAPerTokenReferenceWithClampsEngaged) {
  torch::manual_seed(11);
  for (bool grouped : {true, false}) {
    MoE moe(16, gpt_oss_options(8, 4, 16), torch::TensorOptions());
    init(moe, 0.6);
    moe.experts().set_grouped_mm(grouped);
    ASSERT_TRUE(loom::moe::GroupedExperts::grouped_mm_supported(torch::randn({2, 16}), moe.experts().w1()));
    const torch::Tensor x = torch::randn({3, 7, 16}) * 2.5;
    ClampCounts clamps;
    const double worst = expect_matches_reference(moe, x, &clamps);
    // Both clamps engaged on a real share of the values (and most stayed inside: both branches of
    // the clamp's gradient are exercised).
    EXPECT_GT(clamps.gate, clamps.total / 20) << clamps.gate << " of " << clamps.total;
    EXPECT_GT(clamps.up, clamps.total / 20) << clamps.up << " of " << clamps.total;
    EXPECT_LT(clamps.gate + clamps.up, clamps.total);
    std::printf("%s: worst |loom - reference| / (1 + max) %.2e over output and gradients; clamped gate %lld, up "
                "%lld of %lld\n",
                grouped ? "grouped GEMM" : "per-expert loop", worst, static_cast<long long>(clamps.gate),
                static_cast<long long>(clamps.up), static_cast<long long>(clamps.total));
  }
}

// The selection bias of auxiliary-loss-free balancing composes with GPT-OSS's router: it moves the
// choice (added to the logits), never the weights (the softmax of the chosen unbiased logits).
TEST(GptOssMoE, SelectionBiasChangesTheChoiceNotTheWeights) {
  const loom::moe::RouterOptions o{.n_experts = 4, .top_k = 2, .score_function = ScoreFunction::kSoftmaxAfterTopK};
  const torch::Tensor logits = torch::tensor({{3.0f, 2.0f, 1.0f, 0.0f}});
  const loom::moe::Routing r = loom::moe::route(logits, o, torch::tensor({0.0f, 0.0f, 0.0f, 5.0f}));
  EXPECT_TRUE(torch::equal(r.experts, torch::tensor({{3L, 0L}})));
  EXPECT_LE((r.weights - torch::tensor({{0.0f, 3.0f}}).softmax(-1)).abs().max().item<double>(), 1e-7);
  MoEOptions with_balance = gpt_oss_options(4, 2, 8);
  with_balance.load_balance_coeff = 1e-3;
  MoE moe(8, with_balance, torch::TensorOptions());
  EXPECT_TRUE(moe.expert_bias().defined());
}

// Experts without tokens get zero gradients for their biases as for their weights; a call with no
// token at all still gives every parameter, biases included, a (zero) gradient.
TEST(GptOssMoE, ExpertsWithoutTokensAndNoTokensAtAll) {
  torch::manual_seed(12);
  MoE moe(8, gpt_oss_options(4, 1, 8), torch::TensorOptions());
  init(moe, 0.5);
  {
    torch::NoGradGuard no_grad;
    moe.router().gate().weight().zero_();
    moe.router().gate().parameter("bias").zero_();
    moe.router().gate().parameter("bias")[2].fill_(1.0);  // every token to expert 2
  }
  const torch::Tensor x = torch::randn({6, 8}) * 3;
  ClampCounts clamps;
  expect_matches_reference(moe, x, &clamps);
  const auto g = run(moe, x, false);
  for (int64_t e : {0, 1, 3}) {
    for (const char* name : {"experts.b1", "experts.b2", "experts.b3", "experts.w1"}) {
      EXPECT_EQ(g.at(name)[e].abs().max().item<double>(), 0.0) << name << " " << e;
    }
  }
  EXPECT_GT(g.at("experts.b2")[2].abs().max().item<double>(), 0.0);
  const auto empty = run(moe, torch::zeros({0, 8}), false);
  for (const char* name : {"experts.b1", "experts.b2", "experts.b3", "router.gate.bias"}) {
    ASSERT_TRUE(empty.at(name).defined()) << name;
    EXPECT_EQ(empty.at(name).abs().max().item<double>(), 0.0) << name;
  }
}

TEST(GptOssMoE, ParametersAndNames) {
  MoE moe(16, gpt_oss_options(8, 2, 12), torch::TensorOptions());
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : moe.named_parameters()) shapes[p.name] = p.slot->tensor.sizes().vec();
  const std::map<std::string, std::vector<int64_t>> want = {
      {"router.gate.weight", {8, 16}}, {"router.gate.bias", {8}},   {"experts.w1", {8, 12, 16}},
      {"experts.w2", {8, 16, 12}},     {"experts.w3", {8, 12, 16}}, {"experts.b1", {8, 12}},
      {"experts.b2", {8, 16}},         {"experts.b3", {8, 12}}};
  EXPECT_EQ(shapes, want);
  EXPECT_EQ(moe.experts().stacked_parameter_names(), (std::vector<std::string>{"w1", "w2", "w3", "b1", "b2", "b3"}));
  loom::testing::expect_error<loom::UsageError>(
      [] { ExpertsOptions{.activation = ExpertActivation::kClampedSwiGLU, .swiglu_limit = 0}.validate(); },
      {"swiglu_limit must be > 0, got 0"});
}

// transformers' GptOssExperts computes x @ gate_up_proj[e] + gate_up_proj_bias[e] and takes the
// even columns as the gate, the odd as up; out = h @ down_proj[e] + down_proj_bias[e]. The split
// gives w1/w3/b1/b3/w2 that compute the same, and the inverses give the HF tensors back bitwise.
TEST(GptOssMoE, InterleavedGateUpMapsToW1W3AndBack) {
  torch::manual_seed(13);
  const int64_t e = 3, dim = 8, hidden = 5;
  const torch::Tensor gate_up = torch::randn({e, dim, 2 * hidden});
  const torch::Tensor gate_up_bias = torch::randn({e, 2 * hidden});
  const torch::Tensor down = torch::randn({e, hidden, dim});
  const auto [w1, w3] = loom::moe::split_interleaved_gate_up(gate_up);
  const auto [b1, b3] = loom::moe::split_interleaved_gate_up_bias(gate_up_bias);
  const torch::Tensor w2 = loom::moe::down_proj_to_w2(down);
  EXPECT_EQ(w1.sizes(), (std::vector<int64_t>{e, hidden, dim}));
  EXPECT_EQ(b3.sizes(), (std::vector<int64_t>{e, hidden}));
  EXPECT_EQ(w2.sizes(), (std::vector<int64_t>{e, dim, hidden}));
  const torch::Tensor x = torch::randn({4, dim});
  for (int64_t i = 0; i < e; ++i) {
    const torch::Tensor hf = at::matmul(x, gate_up[i]) + gate_up_bias[i];
    using torch::indexing::Slice;
    EXPECT_TRUE(torch::allclose(hf.index({Slice(), Slice(0, c10::nullopt, 2)}), at::linear(x, w1[i], b1[i]), 1e-6, 1e-6));
    EXPECT_TRUE(torch::allclose(hf.index({Slice(), Slice(1, c10::nullopt, 2)}), at::linear(x, w3[i], b3[i]), 1e-6, 1e-6));
    const torch::Tensor h = torch::randn({4, hidden});
    EXPECT_TRUE(torch::allclose(at::matmul(h, down[i]), at::linear(h, w2[i]), 1e-6, 1e-6));
  }
  EXPECT_TRUE(torch::equal(loom::moe::interleave_gate_up(w1, w3), gate_up));
  EXPECT_TRUE(torch::equal(loom::moe::interleave_gate_up_bias(b1, b3), gate_up_bias));
  EXPECT_TRUE(torch::equal(loom::moe::w2_to_down_proj(w2), down));
}

}  // namespace moe_gpt_oss_tests
