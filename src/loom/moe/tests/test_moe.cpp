// The MoE layer against independent references written as plain loops over tokens: the router's
// expert sets and weights (softmax, sigmoid with a selection bias, group-limited), the block's
// outputs and gradients against a per-token dense computation, experts that get no tokens, a call
// with no tokens at all, and the balancing rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "loom/core/error.h"
#include "loom/moe/moe.h"
#include "loom/testing/errors.h"

namespace moe_tests {

using loom::moe::MoE;
using loom::moe::MoEOptions;
using loom::moe::RouterOptions;
using loom::moe::ScoreFunction;

// The reference router for one token, in double precision: scores, biased choice, optional groups,
// top-k by repeated arg-max, unbiased weights, normalisation and scale.
struct TokenRoute {
  std::vector<int64_t> experts;
  std::vector<double> weights;
};

TokenRoute reference_route(const std::vector<double>& logits, const RouterOptions& o, const std::vector<double>& bias) {
  const int64_t e_count = static_cast<int64_t>(logits.size());
  std::vector<double> scores(e_count);
  if (o.score_function == ScoreFunction::kSoftmax) {
    const double m = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (int64_t e = 0; e < e_count; ++e) sum += scores[e] = std::exp(logits[e] - m);
    for (double& s : scores) s /= sum;
  } else {
    for (int64_t e = 0; e < e_count; ++e) scores[e] = 1.0 / (1.0 + std::exp(-logits[e]));
  }
  std::vector<double> choice = scores;
  for (int64_t e = 0; e < e_count && !bias.empty(); ++e) choice[e] += bias[e];
  std::vector<bool> eligible(e_count, true);
  if (o.n_groups > 1) {
    const int64_t per = e_count / o.n_groups;
    std::vector<std::pair<double, int64_t>> groups;
    for (int64_t g = 0; g < o.n_groups; ++g) {
      std::vector<double> members(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(members.rbegin(), members.rend());
      groups.emplace_back(members[0] + members[1], g);
    }
    std::sort(groups.rbegin(), groups.rend());
    std::vector<bool> kept(o.n_groups, false);
    for (int64_t i = 0; i < o.topk_groups; ++i) kept[groups[i].second] = true;
    for (int64_t e = 0; e < e_count; ++e) eligible[e] = kept[e / per];
  }
  TokenRoute r;
  std::vector<bool> taken(e_count, false);
  for (int64_t k = 0; k < o.top_k; ++k) {
    int64_t best = -1;
    for (int64_t e = 0; e < e_count; ++e) {
      if (eligible[e] && !taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
    }
    taken[best] = true;
    r.experts.push_back(best);
    r.weights.push_back(scores[best]);
  }
  if (o.normalize) {
    const double sum = std::accumulate(r.weights.begin(), r.weights.end(), 0.0);
    for (double& w : r.weights) w /= sum;
  }
  for (double& w : r.weights) w *= o.scale;
  return r;
}

void expect_routes_match(const RouterOptions& o, const torch::Tensor& bias) {
  const int64_t n = 64;
  const torch::Tensor logits = torch::randn({n, o.n_experts}) * 2;
  const loom::moe::Routing got = loom::moe::route(logits, o, bias);
  std::vector<double> b;
  if (bias.defined()) b.assign(bias.data_ptr<float>(), bias.data_ptr<float>() + bias.numel());
  std::vector<int64_t> counts(o.n_experts, 0);
  for (int64_t t = 0; t < n; ++t) {
    const torch::Tensor row = logits[t].to(torch::kDouble).contiguous();
    const TokenRoute want = reference_route(std::vector<double>(row.data_ptr<double>(), row.data_ptr<double>() + o.n_experts), o, b);
    for (int64_t k = 0; k < o.top_k; ++k) {
      EXPECT_EQ(got.experts[t][k].item<int64_t>(), want.experts[k]) << "token " << t << " choice " << k;
      EXPECT_NEAR(got.weights[t][k].item<double>(), want.weights[k], 1e-6) << "token " << t << " choice " << k;
      ++counts[want.experts[k]];
    }
  }
  for (int64_t e = 0; e < o.n_experts; ++e) EXPECT_EQ(got.counts[e].item<int64_t>(), counts[e]) << "expert " << e;
  EXPECT_EQ(got.weights.scalar_type(), torch::kFloat);
}

TEST(Router, SoftmaxTopKMatchesTheReference) {
  torch::manual_seed(0);
  expect_routes_match({.n_experts = 8, .top_k = 2}, {});
  expect_routes_match({.n_experts = 8, .top_k = 2, .normalize = true}, {});  // Qwen3-MoE's norm_topk_prob
  expect_routes_match({.n_experts = 16, .top_k = 4, .normalize = true, .scale = 2.5}, {});
}

TEST(Router, SigmoidWithSelectionBiasMatchesTheReference) {
  torch::manual_seed(1);
  // The bias changes which experts are chosen (large enough to matter), never their weights.
  const torch::Tensor bias = torch::randn({8}) * 0.3;
  expect_routes_match({.n_experts = 8, .top_k = 2, .score_function = ScoreFunction::kSigmoid, .normalize = true}, bias);
  const loom::moe::Routing biased = loom::moe::route(torch::zeros({1, 8}), {.n_experts = 8, .top_k = 2,
                                                     .score_function = ScoreFunction::kSigmoid}, bias);
  const torch::Tensor want = std::get<1>(bias.topk(2));
  EXPECT_TRUE(torch::equal(biased.experts[0], want));
  EXPECT_TRUE(torch::allclose(biased.weights, torch::full({1, 2}, 0.5f)));  // sigmoid(0), unbiased
}

TEST(Router, GroupLimitedRoutingMatchesTheReference) {
  torch::manual_seed(2);
  // DeepSeek-V3's shape in small: 4 groups of 4 experts, the best 2 groups eligible, top 4.
  expect_routes_match({.n_experts = 16, .top_k = 4, .score_function = ScoreFunction::kSigmoid, .normalize = true,
                       .scale = 2.5, .n_groups = 4, .topk_groups = 2},
                      torch::randn({16}) * 0.1);
  expect_routes_match({.n_experts = 16, .top_k = 3, .n_groups = 8, .topk_groups = 3}, {});
}

TEST(Router, BadOptionsAreOneLineUsageErrors) {
  auto bad = [](RouterOptions o, const char* says) {
    loom::testing::expect_error<loom::UsageError>([&] { o.validate(); }, {says});
  };
  bad({.n_experts = 8, .top_k = 9}, "top_k must be in [1, n_experts = 8], got 9");
  bad({.n_experts = 8, .top_k = 2, .n_groups = 3}, "n_groups = 3 must divide n_experts = 8");
  bad({.n_experts = 8, .top_k = 2, .n_groups = 4, .topk_groups = 5}, "topk_groups must be in [1, n_groups = 4]");
}

// The block against a per-token loop: every token's output is the routing-weighted sum of its
// experts' SwiGLU outputs (computed from the same weights, one token at a time) plus the shared
// expert's; gradients of the input and of every weight agree too.
torch::Tensor reference_moe(MoE& moe, const torch::Tensor& x) {
  const torch::Tensor tokens = x.reshape({-1, x.size(-1)});
  const loom::moe::Routing r = loom::moe::route(at::linear(tokens, moe.router().gate().weight()),
                                                moe.options().router, moe.expert_bias().defined() ? moe.expert_bias() : torch::Tensor());
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < tokens.size(0); ++t) {
    torch::Tensor acc = torch::zeros({x.size(-1)});
    for (int64_t k = 0; k < r.experts.size(1); ++k) {
      const int64_t e = r.experts[t][k].item<int64_t>();
      const torch::Tensor xt = tokens[t];
      const torch::Tensor h = at::silu(at::matmul(moe.experts().w1()[e], xt)) * at::matmul(moe.experts().w3()[e], xt);
      acc = acc + r.weights[t][k] * at::matmul(moe.experts().w2()[e], h);
    }
    if (moe.has_shared_experts()) acc = acc + moe.shared_experts().forward(tokens[t].unsqueeze(0)).squeeze(0);
    rows.push_back(acc);
  }
  return torch::stack(rows).view(x.sizes());
}

void init(MoE& moe) {
  torch::NoGradGuard no_grad;
  for (auto& p : moe.named_parameters()) p.slot->tensor.normal_(0, 0.3);
}

std::map<std::string, torch::Tensor> gradients(MoE& moe, const torch::Tensor& x, bool reference) {
  for (auto& p : moe.named_parameters()) p.slot->tensor.mutable_grad() = torch::Tensor();
  torch::Tensor xi = x.detach().clone().requires_grad_(true);
  const torch::Tensor y = reference ? reference_moe(moe, xi) : moe.forward(xi);
  (y * torch::linspace(-1, 1, y.numel()).view(y.sizes())).sum().backward();
  std::map<std::string, torch::Tensor> g{{"input", xi.grad()}, {"output", y.detach()}};
  for (auto& p : moe.named_parameters()) g[p.name] = p.slot->tensor.grad();
  return g;
}

void expect_matches_reference(MoE& moe, const torch::Tensor& x) {
  const auto got = gradients(moe, x, false);
  const auto want = gradients(moe, x, true);
  for (const auto& [name, w] : want) {
    ASSERT_TRUE(got.at(name).defined()) << name;
    EXPECT_LE((got.at(name) - w).abs().max().item<double>(), 1e-5 * (1 + w.abs().max().item<double>())) << name;
  }
}

TEST(MoE, OutputsAndGradientsMatchAPerTokenReference) {
  torch::manual_seed(3);
  MoE moe(16, {.router = {.n_experts = 4, .top_k = 2, .normalize = true}, .hidden_dim = 8}, torch::TensorOptions());
  init(moe);
  expect_matches_reference(moe, torch::randn({2, 5, 16}));
  MoE shared(16, {.router = {.n_experts = 6, .top_k = 3}, .hidden_dim = 8, .shared_hidden_dim = 12}, torch::TensorOptions());
  init(shared);
  expect_matches_reference(shared, torch::randn({3, 4, 16}));
  EXPECT_TRUE(shared.has_shared_experts());
}

// Experts that get no token compute nothing and get zero gradients; a call with no tokens at all
// still gives every weight a (zero) gradient, so such a rank reduces the same parameters.
TEST(MoE, ExpertsWithoutTokensAndNoTokensAtAll) {
  torch::manual_seed(4);
  MoE moe(8, {.router = {.n_experts = 4, .top_k = 1}, .hidden_dim = 8}, torch::TensorOptions());
  init(moe);
  {
    // Steer every token to expert 2: the gate's row 2 dominates for positive inputs.
    torch::NoGradGuard no_grad;
    moe.router().gate().weight().zero_();
    moe.router().gate().weight()[2].fill_(1.0);
  }
  const torch::Tensor x = torch::rand({6, 8}) + 0.1;
  expect_matches_reference(moe, x);
  const auto g = gradients(moe, x, false);
  for (int64_t e : {0, 1, 3}) {
    EXPECT_EQ(g.at("experts.w1")[e].abs().max().item<double>(), 0.0) << e;
    EXPECT_EQ(g.at("experts.w2")[e].abs().max().item<double>(), 0.0) << e;
  }
  EXPECT_GT(g.at("experts.w1")[2].abs().max().item<double>(), 0.0);

  const auto empty = gradients(moe, torch::zeros({0, 8}), false);
  EXPECT_EQ(empty.at("output").sizes(), (std::vector<int64_t>{0, 8}));
  for (const char* name : {"experts.w1", "experts.w2", "experts.w3", "router.gate.weight"}) {
    ASSERT_TRUE(empty.at(name).defined()) << name;
    EXPECT_EQ(empty.at(name).abs().max().item<double>(), 0.0) << name;
  }
}

// The grouped GEMM (at::_grouped_mm, the CPU kernel here) and the per-expert loop give the same
// outputs and gradients, with an expert that gets no rows, and with the expanded (stride-0) output
// gradient a plain sum() gives, which at::_grouped_mm's backward would reject.
TEST(MoE, GroupedGemmMatchesThePerExpertLoop) {
  torch::manual_seed(6);
  loom::moe::GroupedExperts experts(4, 16, 8, torch::TensorOptions());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : experts.named_parameters()) p.slot->tensor.normal_(0, 0.3);
  }
  ASSERT_TRUE(loom::moe::GroupedExperts::grouped_mm_supported(torch::randn({2, 16}), experts.w1()));
  const torch::Tensor x = torch::randn({9, 16});
  const std::vector<int64_t> counts = {3, 0, 5, 1};
  auto run = [&](bool grouped, bool plain_sum) {
    experts.set_grouped_mm(grouped);
    for (auto& p : experts.named_parameters()) p.slot->tensor.mutable_grad() = torch::Tensor();
    torch::Tensor xi = x.clone().requires_grad_(true);
    const torch::Tensor y = experts.forward(xi, counts);
    (plain_sum ? y.sum() : (y * torch::linspace(-1, 1, y.numel()).view(y.sizes())).sum()).backward();
    std::vector<torch::Tensor> out = {y.detach(), xi.grad()};
    for (auto& p : experts.named_parameters()) out.push_back(p.slot->tensor.grad());
    return out;
  };
  for (bool plain_sum : {false, true}) {
    const auto grouped = run(true, plain_sum), loop = run(false, plain_sum);
    for (size_t i = 0; i < grouped.size(); ++i) {
      EXPECT_LE((grouped[i] - loop[i]).abs().max().item<double>(), 1e-6 * (1 + loop[i].abs().max().item<double>()))
          << "tensor " << i << (plain_sum ? " (sum)" : "");
    }
    EXPECT_EQ(grouped[3][1].abs().max().item<double>(), 0.0);  // w1 of the expert without rows
  }
}

// Auxiliary-loss-free balancing: experts above the mean load lose `coeff`, those below gain it,
// re-centred to mean 0; the counts accumulate over forwards (micro-batches) until the step.
TEST(MoE, BalancingMovesTheBiasAgainstTheLoad) {
  const torch::Tensor delta = loom::moe::expert_bias_update(torch::tensor({10.0f, 2.0f, 6.0f, 6.0f}), 1e-3);
  EXPECT_TRUE(torch::allclose(delta, torch::tensor({-1e-3f, 1e-3f, 0.0f, 0.0f}), 0, 1e-9)) << delta;
  EXPECT_NEAR(delta.sum().item<double>(), 0.0, 1e-12);

  torch::manual_seed(5);
  MoE moe(8, {.router = {.n_experts = 4, .top_k = 2}, .hidden_dim = 8, .load_balance_coeff = 1e-3}, torch::TensorOptions());
  init(moe);
  const torch::Tensor a = torch::randn({5, 8}), b = torch::randn({7, 8});
  moe.forward(a);
  moe.forward(b);
  EXPECT_EQ(moe.tokens_per_expert().sum().item<double>(), (5 + 7) * 2);
  {
    torch::NoGradGuard no_grad;  // an evaluation forward does not count
    moe.forward(a);
  }
  EXPECT_EQ(moe.tokens_per_expert().sum().item<double>(), (5 + 7) * 2);
  const torch::Tensor counts = moe.tokens_per_expert().clone();
  moe.balance_experts(counts);
  EXPECT_TRUE(torch::allclose(moe.expert_bias(), loom::moe::expert_bias_update(counts, 1e-3)));
  EXPECT_EQ(moe.tokens_per_expert().sum().item<double>(), 0.0);
  // The bias is saved with the model; the counts are not.
  bool bias_saved = false, counts_saved = false;
  for (const auto& b : moe.named_buffers()) {
    if (b.name == "expert_bias") bias_saved = b.slot->persistent;
    if (b.name == "tokens_per_expert") counts_saved = b.slot->persistent;
  }
  EXPECT_TRUE(bias_saved);
  EXPECT_FALSE(counts_saved);
}

}  // namespace moe_tests
