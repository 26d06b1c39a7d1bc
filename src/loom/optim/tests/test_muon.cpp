// Muon: Newton-Schulz against the SVD's polar factor (an independent reference: LAPACK's singular
// vectors), the split rule, one step against its formula written out, the AdamW part against
// optim::AdamW, and the state dict. The comparison with a Python reference (Keller Jordan's
// zeropower_via_newtonschulz5 and torch.optim.Muon) is tests/parity/test_muon_parity.py.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>

#include "loom/core/error.h"
#include "loom/optim/adamw.h"
#include "loom/optim/muon.h"

namespace {
using namespace loom::optim;

torch::Tensor randn(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, torch::kFloat32);
}

// A rows x cols matrix U diag(s) V^T with singular values from 1 down to 1 / condition
// (geometrically spaced) and random orthonormal U, V.
struct Conditioned {
  torch::Tensor x, u, v, s;
};
Conditioned conditioned(int64_t rows, int64_t cols, double condition, uint64_t seed) {
  const int64_t k = std::min(rows, cols);
  const torch::Tensor u = std::get<0>(torch::linalg_qr(randn({rows, k}, seed)));
  const torch::Tensor v = std::get<0>(torch::linalg_qr(randn({cols, k}, seed + 1)));
  const torch::Tensor s = torch::logspace(0, -std::log10(condition), k, 10.0, torch::kFloat32);
  return {u.matmul(torch::diag(s)).matmul(v.t()), u, v, s};
}

// The quintic does not converge to 1: after 5 steps every singular value that started at least
// 1e-2 of the Frobenius norm lies in [0.68, 1.21] (measured on these matrices); the band asserted
// leaves a little room. Smaller ones grow by at most a^5 ~ 484 and stay below it.
constexpr double kBandLow = 0.65, kBandHigh = 1.25;

}  // namespace

TEST(NewtonSchulz, RandomMatricesGetSingularValuesInTheQuinticBand) {
  uint64_t seed = 1;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{64, 128}, {128, 64}, {96, 200}, {200, 96}}) {
    const torch::Tensor x = randn(shape, seed++);
    const torch::Tensor o = newton_schulz(x, 5);
    ASSERT_EQ(o.sizes(), x.sizes());
    const torch::Tensor sv = torch::linalg_svdvals(o);
    const double lo = sv.min().item<double>(), hi = sv.max().item<double>();
    EXPECT_GE(lo, kBandLow) << shape[0] << "x" << shape[1];
    EXPECT_LE(hi, kBandHigh) << shape[0] << "x" << shape[1];
    // The direction of the polar factor U V^T (the exact orthogonalisation, from LAPACK's SVD).
    auto [u, s, vh] = torch::linalg_svd(x, false);
    const torch::Tensor polar = u.matmul(vh);
    const double cosine = (o * polar).sum().item<double>() / (o.norm() * polar.norm()).item<double>();
    EXPECT_GE(cosine, 0.97);
    std::printf("%4lldx%-4lld singular values of NS(X) in [%.4f, %.4f], cosine with U V^T %.4f\n",
                static_cast<long long>(shape[0]), static_cast<long long>(shape[1]), lo, hi, cosine);
  }
}

// Ill-conditioned matrices: NS keeps X's singular vectors (U^T NS(X) V is diagonal) and maps each
// singular value on its own; those not too small land in the band, the tiny ones stay below it
// and never above.
TEST(NewtonSchulz, IllConditionedMatricesKeepTheirSingularVectors) {
  for (double condition : {1e2, 1e4, 1e6}) {
    const Conditioned c = conditioned(64, 128, condition, 11);
    const torch::Tensor o = newton_schulz(c.x, 5);
    const torch::Tensor in_basis = c.u.t().matmul(o).matmul(c.v);
    const torch::Tensor d = torch::diagonal(in_basis);
    const double off = (in_basis - torch::diag(d)).abs().max().item<double>();
    EXPECT_LE(off, 1e-4) << condition;
    const torch::Tensor relative = c.s / c.x.norm();
    const torch::Tensor big = d.masked_select(relative >= 1e-2);
    ASSERT_GT(big.numel(), 0);
    EXPECT_GE(big.min().item<double>(), kBandLow) << condition;
    EXPECT_LE(d.max().item<double>(), kBandHigh) << condition;
    EXPECT_GT(d.min().item<double>(), 0.0) << condition;  // no sign flip
    std::printf("condition %.0e: off-diagonal of U^T NS(X) V %.1e; %lld of 64 singular values >= 1e-2 "
                "of ||X||_F, mapped into [%.4f, %.4f]; smallest %.2e\n",
                condition, off, static_cast<long long>(big.numel()), big.min().item<double>(),
                big.max().item<double>(), d.min().item<double>());
  }
}

TEST(NewtonSchulz, TallMatricesAreIteratedTransposed) {
  const torch::Tensor x = randn({96, 40}, 5);
  // (To float32 rounding: the transposed view takes another BLAS path.)
  EXPECT_LE((newton_schulz(x, 5) - newton_schulz(x.t().contiguous(), 5).t()).abs().max().item<double>(), 1e-6);
  // A zero matrix stays zero (eps keeps the normalisation finite).
  EXPECT_TRUE(torch::equal(newton_schulz(torch::zeros({8, 4}), 5), torch::zeros({8, 4})));
}

TEST(Muon, SplitRuleTakesHiddenMatricesOnly) {
  EXPECT_TRUE(is_muon_parameter("layers.0.attention.wq.weight", {256, 256}));
  EXPECT_TRUE(is_muon_parameter("layers.3.feed_forward.w2.weight", {256, 768}));
  EXPECT_TRUE(is_muon_parameter("attention.wo.weight", {256, 256}));  // relative to a block
  EXPECT_FALSE(is_muon_parameter("tok_embeddings.weight", {2048, 256}));
  EXPECT_FALSE(is_muon_parameter("output.weight", {2048, 256}));
  EXPECT_FALSE(is_muon_parameter("model.output.weight", {2048, 256}));
  EXPECT_FALSE(is_muon_parameter("layers.0.attention_norm.weight", {256}));
  EXPECT_FALSE(is_muon_parameter("layers.0.attention.wq.bias", {256}));
  EXPECT_FALSE(is_muon_parameter("conv.weight", {4, 3, 3, 3}));
  EXPECT_TRUE(is_muon_parameter("outputs.weight", {4, 4}));  // only the component "output"
  // A routed-experts stack: 3-D weights, and GPT-OSS's stacked biases [experts, width], which
  // expert parallelism splits by expert (orthogonalising the stack would mix experts, and differ
  // by layout). The router's gate is a matrix.
  EXPECT_FALSE(is_muon_parameter("layers.0.moe.experts.w1", {8, 64, 256}));
  EXPECT_FALSE(is_muon_parameter("layers.0.moe.experts.b1", {8, 64}));
  EXPECT_FALSE(is_muon_parameter("layers.0.moe.experts.b2", {8, 256}));
  EXPECT_TRUE(is_muon_parameter("layers.0.moe.router.gate.weight", {8, 256}));
}

TEST(Muon, LearningRateScale) {
  EXPECT_DOUBLE_EQ(muon_lr_scale(256, 768, MuonLRAdjust::kMatchRmsAdamW), 0.2 * std::sqrt(768.0));
  EXPECT_DOUBLE_EQ(muon_lr_scale(768, 256, MuonLRAdjust::kMatchRmsAdamW), 0.2 * std::sqrt(768.0));
  EXPECT_DOUBLE_EQ(muon_lr_scale(768, 256, MuonLRAdjust::kOriginal), std::sqrt(3.0));
  EXPECT_DOUBLE_EQ(muon_lr_scale(256, 768, MuonLRAdjust::kOriginal), 1.0);
  EXPECT_EQ(loom::options::parse_enum<MuonLRAdjust>("original", "optimizer.muon_adjust_lr"), MuonLRAdjust::kOriginal);
  EXPECT_THROW(loom::options::parse_enum<MuonLRAdjust>("spectral", "optimizer.muon_adjust_lr"), loom::UsageError);
}

// Two steps of a matrix, a 1-D scale and an embedding: the matrix follows the formula written out
// here (momentum, Nesterov, NS, decay, scaled step), the others are bitwise optim::AdamW's.
TEST(Muon, StepsFollowTheFormulaAndAdamWForTheRest) {
  const double lr = 0.02, wd = 0.1;
  for (bool nesterov : {true, false}) {
    torch::Tensor w = randn({24, 40}, 1), scale = randn({40}, 2), emb = randn({50, 40}, 3);
    NamedTensors named = {{"layers.0.attention.wq.weight", w}, {"layers.0.norm.weight", scale},
                          {"tok_embeddings.weight", emb}};
    torch::Tensor ref_scale = scale.clone(), ref_emb = emb.clone(), ref_w = w.clone();
    MuonOptions mo;
    mo.nesterov = nesterov;
    Muon muon(weight_decay_param_groups(named, wd), AdamWOptions{.lr = lr}, mo);
    EXPECT_EQ(muon.muon_parameter_names(), std::vector<std::string>{"layers.0.attention.wq.weight"});
    AdamW adamw(weight_decay_param_groups({{"layers.0.norm.weight", ref_scale}, {"tok_embeddings.weight", ref_emb}}, wd),
                AdamWOptions{.lr = lr});
    torch::Tensor buf = torch::zeros_like(w);
    for (int step = 0; step < 2; ++step) {
      const torch::Tensor gw = randn({24, 40}, 10 + step), gs = randn({40}, 20 + step), ge = randn({50, 40}, 30 + step);
      w.mutable_grad() = gw.clone();
      scale.mutable_grad() = gs.clone();
      emb.mutable_grad() = ge.clone();
      muon.step();
      ref_scale.mutable_grad() = gs.clone();
      ref_emb.mutable_grad() = ge.clone();
      adamw.step();
      buf = 0.95 * buf + gw;
      const torch::Tensor dir = nesterov ? gw + 0.95 * buf : buf;
      ref_w = ref_w * (1 - lr * wd) - lr * 0.2 * std::sqrt(40.0) * newton_schulz(dir, 5);
      EXPECT_LE((w - ref_w).abs().max().item<double>(), 1e-6) << "nesterov " << nesterov << " step " << step;
      EXPECT_TRUE(torch::equal(scale, ref_scale));
      EXPECT_TRUE(torch::equal(emb, ref_emb));
    }
    EXPECT_EQ(muon.state_dict().at("layers.0.attention.wq.weight.step").item<float>(), 2.0f);
  }
}

TEST(Muon, StateDictRoundTripsAndRejectsAMismatch) {
  auto make = [](torch::Tensor& w, torch::Tensor& b) {
    return std::make_unique<Muon>(
        weight_decay_param_groups({{"layers.0.w1.weight", w}, {"layers.0.norm.weight", b}}, 0.1),
        AdamWOptions{.lr = 0.01}, MuonOptions{});
  };
  torch::Tensor w = randn({16, 8}, 1), b = randn({8}, 2);
  auto a = make(w, b);
  for (int s = 0; s < 3; ++s) {
    w.mutable_grad() = randn({16, 8}, 40 + s);
    b.mutable_grad() = randn({8}, 50 + s);
    a->step();
  }
  const TensorDict sd = a->state_dict();
  for (const char* key : {"layers.0.w1.weight.momentum_buffer", "layers.0.w1.weight.step",
                          "layers.0.norm.weight.exp_avg", "layers.0.norm.weight.exp_avg_sq",
                          "layers.0.norm.weight.step"}) {
    EXPECT_EQ(sd.count(key), 1u) << key;
  }
  EXPECT_EQ(sd.size(), 5u);
  EXPECT_GT(sd.at("layers.0.w1.weight.momentum_buffer").abs().max().item<float>(), 0.0f);

  // A fresh optimizer with the loaded state continues bitwise like the original.
  torch::Tensor w2 = w.clone(), b2 = b.clone();
  auto c = make(w2, b2);
  TensorDict copy;
  for (const auto& [k, t] : sd) copy[k] = t.clone();
  c->load_state_dict(copy);
  auto step = [](Muon& opt, torch::Tensor& pw, torch::Tensor& pb) {
    pw.mutable_grad() = randn({16, 8}, 60);
    pb.mutable_grad() = randn({8}, 61);
    opt.step();
  };
  step(*a, w, b);
  step(*c, w2, b2);
  EXPECT_TRUE(torch::equal(w, w2));
  EXPECT_TRUE(torch::equal(b, b2));

  TensorDict missing = copy;
  missing.erase("layers.0.w1.weight.momentum_buffer");
  EXPECT_THROW(c->load_state_dict(missing), loom::Error);
  TensorDict wrong = copy;
  wrong["layers.0.w1.weight.momentum_buffer"] = torch::zeros({8, 16});
  EXPECT_THROW(c->load_state_dict(wrong), loom::Error);
  TensorDict extra = copy;
  extra["layers.0.w1.weight.exp_avg"] = torch::zeros({16, 8});  // AdamW state for a Muon matrix
  EXPECT_THROW(c->load_state_dict(extra), loom::Error);
  EXPECT_THROW(Muon(weight_decay_param_groups({{"w", w}}, 0.0), AdamWOptions{}, MuonOptions{.momentum = 1.0}),
               loom::UsageError);
}
