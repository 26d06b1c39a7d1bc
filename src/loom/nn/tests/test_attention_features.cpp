// GPT-OSS's attention features in the one-process core (nn/attention.h): learned sinks, sliding
// window, block-causal documents with either, and biased projections, each against an explicit
// float64 softmax over [masked scores, sink] (Hugging Face's eager GptOssAttention math), forward
// and the q, k, v and sinks gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "loom/core/error.h"
#include "loom/nn/attention.h"
#include "loom/nn/rope.h"

namespace {
using namespace loom::nn;

// The explicit reference in float64: q [B, H, Tq, D], k, v [B, KV, Tk, D], `allowed` bool
// broadcastable to [B, H, Tq, Tk], sinks [H] or undefined.
torch::Tensor reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& allowed, const torch::Tensor& sinks) {
  const int64_t groups = q.size(1) / k.size(1);
  const torch::Tensor keys = k.repeat_interleave(groups, 1), values = v.repeat_interleave(groups, 1);
  torch::Tensor scores = torch::matmul(q, keys.transpose(-1, -2)) / std::sqrt(double(q.size(-1)));
  scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  if (sinks.defined()) {
    const torch::Tensor column = sinks.view({1, -1, 1, 1}).expand({q.size(0), -1, q.size(2), 1});
    const torch::Tensor probs = torch::cat({scores, column}, -1).softmax(-1).narrow(-1, 0, k.size(2));
    return torch::matmul(probs, values);
  }
  return torch::matmul(scores.softmax(-1), values);
}

double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-12);
}

struct Diffs {
  double out = 0, dq = 0, dk = 0, dv = 0, dsinks = 0;
  double worst() const { return std::max({out, dq, dk, dv, dsinks}); }
};

// Runs `core` (float32, [B, T, H, D] in, [B, T, H * D] out) on random q, k, v and a sink vector
// (when `with_sinks`), back-propagates a random gradient, and compares with the reference under
// `allowed` [B or 1, 1, T, T].
template <typename Core>
Diffs compare(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, bool with_sinks, const torch::Tensor& allowed,
              Core core, uint64_t seed = 3) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const torch::Tensor q0 = torch::randn({B, T, H, D}, gen, torch::kFloat64);
  const torch::Tensor k0 = torch::randn({B, T, KV, D}, gen, torch::kFloat64);
  const torch::Tensor v0 = torch::randn({B, T, KV, D}, gen, torch::kFloat64);
  const torch::Tensor s0 = torch::randn({H}, gen, torch::kFloat64) * 2;
  const torch::Tensor g0 = torch::randn({B, T, H * D}, gen, torch::kFloat64);
  torch::Tensor q = q0.to(torch::kFloat32).requires_grad_(), k = k0.to(torch::kFloat32).requires_grad_(),
                v = v0.to(torch::kFloat32).requires_grad_();
  torch::Tensor s = with_sinks ? s0.to(torch::kFloat32).requires_grad_() : torch::Tensor();
  const torch::Tensor out = core(q, k, v, s);
  out.backward(g0.to(torch::kFloat32));

  torch::Tensor qr = q0.clone().requires_grad_(), kr = k0.clone().requires_grad_(), vr = v0.clone().requires_grad_();
  torch::Tensor sr = with_sinks ? s0.clone().requires_grad_() : torch::Tensor();
  const torch::Tensor want =
      reference(qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), allowed, sr).transpose(1, 2).reshape({B, T, H * D});
  want.backward(g0);
  Diffs d;
  d.out = rel(out, want);
  d.dq = rel(q.grad(), qr.grad());
  d.dk = rel(k.grad(), kr.grad());
  d.dv = rel(v.grad(), vr.grad());
  if (with_sinks) d.dsinks = rel(s.grad(), sr.grad());
  return d;
}

torch::Tensor causal_allowed(int64_t T, int64_t window, const torch::Tensor& docs = torch::Tensor()) {
  const torch::Tensor pos = torch::arange(T, torch::kInt64);
  torch::Tensor allowed = torch::ones({T, T}, torch::kBool).tril();
  if (window > 0) allowed = allowed.logical_and((pos.unsqueeze(1) - pos.unsqueeze(0)) < window);
  allowed = allowed.unsqueeze(0);
  if (docs.defined()) allowed = allowed.logical_and(docs.unsqueeze(2) == docs.unsqueeze(1));
  return allowed.unsqueeze(1);
}

constexpr double kTol = 2e-5;  // float32 kernels against the float64 reference, relative to the largest value

// Hugging Face's convention: a query at i sees keys i - window < j <= i (itself and window - 1 before).
TEST(AttentionFeatures, SlidingWindowMaskIsHuggingFacesConvention) {
  const torch::Tensor m = attention_mask(torch::arange(6, torch::kInt64), torch::arange(6, torch::kInt64), 3);
  ASSERT_EQ(m.sizes(), (std::vector<int64_t>{1, 1, 6, 6}));
  const torch::Tensor want = torch::tensor({1, 0, 0, 0, 0, 0,  //
                                            1, 1, 0, 0, 0, 0,  //
                                            1, 1, 1, 0, 0, 0,  //
                                            0, 1, 1, 1, 0, 0,  //
                                            0, 0, 1, 1, 1, 0,  //
                                            0, 0, 0, 1, 1, 1}, torch::kBool).view({1, 1, 6, 6});
  EXPECT_TRUE(torch::equal(m, want));
  // Queries at later positions (a KV-cache decode step) against every cached key.
  const torch::Tensor step = attention_mask(torch::tensor({4}, torch::kInt64), torch::arange(6, torch::kInt64), 3);
  EXPECT_TRUE(torch::equal(step.view({6}), torch::tensor({0, 0, 1, 1, 1, 0}, torch::kBool)));
}

// sink_attention alone: causal and masked, GQA, CPU flash kernel with the sink correction.
TEST(AttentionFeatures, SinkAttentionMatchesExplicitSoftmax) {
  const int64_t B = 2, T = 24, H = 4, KV = 2, D = 16;
  for (int64_t window : {0, 5}) {
    const torch::Tensor allowed = causal_allowed(T, window);
    const Diffs d = compare(B, T, H, KV, D, true, allowed,
                            [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& s) {
                              std::optional<torch::Tensor> mask;
                              if (window > 0) mask = allowed;
                              return sink_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                                    window == 0, s)
                                  .transpose(1, 2)
                                  .reshape({B, T, H * D});
                            });
    std::printf("sink_attention window %ld: out %.2e dq %.2e dk %.2e dv %.2e dsinks %.2e\n", window, d.out, d.dq,
                d.dk, d.dv, d.dsinks);
    EXPECT_LE(d.worst(), kTol) << "window " << window;
  }
  // A very negative sink weighs nothing: plain attention.
  const torch::Tensor q = torch::randn({1, 2, 8, 8}), k = torch::randn({1, 2, 8, 8}), v = torch::randn({1, 2, 8, 8});
  const torch::Tensor plain = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true);
  EXPECT_LE((sink_attention(q, k, v, std::nullopt, true, torch::full({2}, -1e4)) - plain).abs().max().item<double>(),
            1e-6);
  EXPECT_THROW(sink_attention(q, k, v, std::nullopt, true, torch::zeros({3})), loom::Error);
}

// The one-process core (SelfAttention::sdpa_attend) with every combination of sinks, window and
// documents, at a length that takes one block and at one long enough to be cut into query chunks
// that skip the keys outside the window (window smaller and larger than a chunk).
TEST(AttentionFeatures, CoreWithSinksWindowAndDocumentsMatchesReference) {
  const int64_t H = 4, KV = 2, D = 8, B = 2;
  Attention attn(H * D, H, KV, torch::kFloat32);
  struct Case {
    int64_t seq, window;
    bool sinks, documents;
  };
  const int64_t chunk = SelfAttention::kWindowChunk;
  const std::vector<Case> cases = {
      {40, 0, true, false},  {40, 7, false, false}, {40, 7, true, false},  {40, 0, true, true},
      {40, 7, false, true},  {40, 7, true, true},   {40, 64, true, false},  // window longer than the row
      {3 * chunk - 5, 9, true, false}, {3 * chunk - 5, 9, false, true},   {3 * chunk - 5, chunk + 20, true, true},
      {3 * chunk - 5, 9, true, true},
  };
  for (const Case& c : cases) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    TokenLayout layout;
    torch::Tensor docs;
    if (c.documents) {
      docs = (torch::rand({B, c.seq}, gen) < 0.08).to(torch::kInt64).cumsum(1);
      layout.document_ids = docs;
    }
    const Diffs d = compare(B, c.seq, H, KV, D, c.sinks, causal_allowed(c.seq, c.window, docs),
                            [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& s) {
                              AttendFeatures f;
                              f.sinks = s;
                              f.sliding_window = c.window;
                              return attn.sdpa_attend(q, k, v, layout, f);
                            });
    std::printf("core T=%ld window=%ld sinks=%d documents=%d: out %.2e dq %.2e dk %.2e dv %.2e dsinks %.2e\n",
                c.seq, c.window, c.sinks, c.documents, d.out, d.dq, d.dk, d.dv, d.dsinks);
    EXPECT_LE(d.worst(), kTol) << "T " << c.seq << " window " << c.window << " sinks " << c.sinks << " documents "
                               << c.documents;
  }
}

// An Attention layer built with the GPT-OSS options: parameters by name, features handed to the
// core, and the whole layer (biased projections, RoPE, sinks, window) against explicit math.
TEST(AttentionFeatures, LayerWithBiasSinksAndWindowMatchesExplicitMath) {
  const int64_t dim = 32, H = 4, KV = 2, hd = 8, B = 2, T = 20;
  AttentionOptions o;
  o.sinks = true;
  o.sliding_window = 6;
  o.bias = true;
  Attention attn(dim, H, KV, torch::kFloat32, o);
  std::vector<std::string> names;
  for (const auto& p : attn.named_parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"sinks", "wq.weight", "wq.bias", "wk.weight", "wk.bias", "wv.weight",
                                             "wv.bias", "wo.weight", "wo.bias"}));
  EXPECT_TRUE(attn.has_sinks() && attn.has_bias());
  EXPECT_EQ(attn.sliding_window(), 6);
  EXPECT_EQ(attn.features().sinks.sizes(), (std::vector<int64_t>{H}));
  torch::manual_seed(4);
  for (auto& p : attn.named_parameters()) attn.set_parameter(p.name, torch::randn(p.tensor().sizes()) * 0.3);
  const torch::Tensor cache = rope_cache(rope_inverse_frequencies(hd, 10000.0, std::nullopt), T);
  const torch::Tensor x = torch::randn({B, T, dim});
  const torch::Tensor y = attn.forward(x, cache);

  auto lin = [&](const std::string& n, const torch::Tensor& in) {
    return torch::matmul(in, attn.parameter(n + ".weight").t()) + attn.parameter(n + ".bias");
  };
  torch::Tensor q = lin("wq", x).view({B, T, H, hd}), k = lin("wk", x).view({B, T, KV, hd}),
                v = lin("wv", x).view({B, T, KV, hd});
  q = apply_rotary_embedding(q, cache).transpose(1, 2);
  k = apply_rotary_embedding(k, cache).transpose(1, 2);
  const torch::Tensor out = reference(q.to(torch::kFloat64), k.to(torch::kFloat64), v.transpose(1, 2).to(torch::kFloat64),
                                      causal_allowed(T, 6), attn.parameter("sinks").to(torch::kFloat64));
  const torch::Tensor want = lin("wo", out.transpose(1, 2).reshape({B, T, H * hd}).to(torch::kFloat32));
  const double d = rel(y, want.to(torch::kFloat64));
  std::printf("layer: max relative difference %.2e\n", d);
  EXPECT_LE(d, 1e-5);
  EXPECT_THROW(Attention(dim, H, KV, torch::kFloat32, AttentionOptions{0, std::nullopt, false, -1, false}), loom::Error);
}

}  // namespace
