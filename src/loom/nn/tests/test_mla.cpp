// Multi-head latent attention against a reference written from DeepSeek's description: RoPE on
// interleaved pairs (x_2i, x_2i+1) rotated by position x theta^(-2i/d), the shared rope key, the
// latent's keys and values, and an explicit softmax scale. Loom de-interleaves and rotates halves
// instead; the outputs must agree (within float rounding), with and without the low-rank query path.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/nn/mla.h"
#include "loom/nn/rope.h"

namespace mla_tests {

using loom::nn::MLAOptions;
using loom::nn::MultiHeadLatentAttention;

// Rotates interleaved pairs of x [B, T, H, d] at positions 0..T-1.
torch::Tensor rotate_interleaved(const torch::Tensor& x, double theta) {
  const int64_t t = x.size(1), d = x.size(3);
  const torch::Tensor inv = 1.0 / torch::pow(theta, torch::arange(0, d, 2, torch::kDouble) / d);
  const torch::Tensor angle = torch::arange(t, torch::kDouble).unsqueeze(1) * inv.unsqueeze(0);  // [T, d/2]
  const torch::Tensor c = angle.cos().view({1, t, 1, d / 2}), s = angle.sin().view({1, t, 1, d / 2});
  const torch::Tensor even = x.index({"...", torch::indexing::Slice(0, torch::indexing::None, 2)}).to(torch::kDouble);
  const torch::Tensor odd = x.index({"...", torch::indexing::Slice(1, torch::indexing::None, 2)}).to(torch::kDouble);
  return torch::stack({even * c - odd * s, odd * c + even * s}, -1).view(x.sizes());
}

torch::Tensor reference(MultiHeadLatentAttention& mla, const torch::Tensor& x, const MLAOptions& o, double theta) {
  const int64_t b = x.size(0), t = x.size(1), h = o.n_heads, dn = o.qk_nope_head_dim, dr = o.qk_rope_head_dim;
  auto w = [&](const std::string& name) { return mla.parameter(name).to(torch::kDouble); };
  auto rms = [&](const torch::Tensor& v, const torch::Tensor& g) {
    return v * torch::rsqrt(v.pow(2).mean(-1, true) + o.norm_eps) * g;
  };
  const torch::Tensor xd = x.to(torch::kDouble);
  torch::Tensor q = o.q_lora_rank == 0 ? at::linear(xd, w("wq.weight"))
                                       : at::linear(rms(at::linear(xd, w("wq_a.weight")), w("q_norm.weight")), w("wq_b.weight"));
  q = q.view({b, t, h, dn + dr});
  const torch::Tensor latent = at::linear(xd, w("wkv_a.weight"));
  const torch::Tensor kv = at::linear(rms(latent.narrow(-1, 0, o.kv_lora_rank), w("kv_norm.weight")), w("wkv_b.weight"))
                               .view({b, t, h, dn + o.v_head_dim});
  const torch::Tensor k_rope = rotate_interleaved(latent.narrow(-1, o.kv_lora_rank, dr).reshape({b, t, 1, dr}), theta);
  const torch::Tensor qf = torch::cat({q.narrow(-1, 0, dn), rotate_interleaved(q.narrow(-1, dn, dr).contiguous(), theta)}, -1);
  const torch::Tensor kf = torch::cat({kv.narrow(-1, 0, dn), k_rope.expand({b, t, h, dr})}, -1);
  const torch::Tensor v = kv.narrow(-1, dn, o.v_head_dim);
  torch::Tensor scores = torch::einsum("bthd,bshd->bhts", {qf, kf}) * (o.softmax_scale / std::sqrt(double(dn + dr)));
  scores = scores.masked_fill(torch::ones({t, t}, torch::kBool).triu(1), -INFINITY);
  const torch::Tensor out = torch::einsum("bhts,bshd->bthd", {scores.softmax(-1), v}).reshape({b, t, h * o.v_head_dim});
  return at::linear(out, w("wo.weight"));
}

TEST(MultiHeadLatentAttention, MatchesInterleavedRopeReference) {
  for (int64_t q_lora : {0, 12}) {
    for (double scale : {1.0, 1.37}) {
      torch::manual_seed(q_lora + 1);
      MLAOptions o;
      o.n_heads = 3, o.q_lora_rank = q_lora, o.kv_lora_rank = 10, o.qk_nope_head_dim = 6, o.qk_rope_head_dim = 4;
      o.v_head_dim = 5, o.softmax_scale = scale;
      MultiHeadLatentAttention mla(16, o, torch::TensorOptions());
      {
        torch::NoGradGuard no_grad;
        for (const auto& p : mla.named_parameters()) p.slot->tensor.normal_(0, 0.4);
      }
      const double theta = 10000.0;
      const torch::Tensor cache =
          loom::nn::rope_cache(loom::nn::rope_inverse_frequencies(o.qk_rope_head_dim, theta, std::nullopt), 32);
      const torch::Tensor x = torch::randn({2, 7, 16});
      const torch::Tensor got = mla.forward(x, cache);
      const torch::Tensor want = reference(mla, x, o, theta);
      EXPECT_EQ(got.sizes(), (std::vector<int64_t>{2, 7, 16}));
      EXPECT_LE((got.to(torch::kDouble) - want).abs().max().item<double>(), 1e-5)
          << "q_lora " << q_lora << " scale " << scale;
    }
  }
}

TEST(MultiHeadLatentAttention, DeinterleavesPairs) {
  const torch::Tensor x = torch::arange(8).view({1, 8});
  EXPECT_TRUE(torch::equal(loom::nn::deinterleave_pairs(x), torch::tensor({0, 2, 4, 6, 1, 3, 5, 7}).view({1, 8})));
}

}  // namespace mla_tests
