// Multi-head latent attention (DeepSeek-V2/V3's MLA, TorchTitan's deepseek_v3 Attention): keys and
// values come from one low-rank latent per token, and only a small shared part of each key carries
// the position.
//
//   queries   q = wq x                                  (q_lora_rank = 0)
//             q = wq_b(q_norm(wq_a x))                  (a low-rank path of rank q_lora_rank)
//             each head [qk_nope_head_dim | qk_rope_head_dim]; RoPE on the rope part
//   latent    [c | k_rope] = wkv_a x                    c: kv_lora_rank, k_rope: qk_rope_head_dim
//   keys      [k_nope | v] = wkv_b(kv_norm(c)) per head, k = [k_nope | RoPE(k_rope)] (k_rope shared
//             by every head), values v of v_head_dim
//   output    wo(attention(q, k, v)), softmax scale softmax_scale / sqrt(qk_nope + qk_rope)
//
// The rope parts follow DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... when rope_interleave
// (the published checkpoints): they are de-interleaved to nn/rope.h's rotate-half layout first,
// which rotates the same pairs by the same angles (the q.k products are unchanged by the common
// permutation). A softmax scale other than 1 (YaRN's mscale^2) is folded into q.
//
// Names: wq or wq_a, q_norm, wq_b; wkv_a, kv_norm, wkv_b; wo. Head counts come from the
// projections' outputs, so tensor parallelism (wq/wq_b and wkv_b colwise, wo rowwise) needs
// nothing here. The core is SelfAttention's (context parallel and the KV cache replace it).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>

#include "loom/nn/attention.h"
#include "loom/nn/layers.h"

namespace loom::nn {

struct MLAOptions {
  int64_t n_heads = 0;
  int64_t q_lora_rank = 0;  // 0: queries through one projection wq
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  double norm_eps = 1e-6;        // q_norm and kv_norm
  bool rope_interleave = true;   // DeepSeek's interleaved rope pairs
  double softmax_scale = 1.0;    // times 1 / sqrt(qk head width)
};

class MultiHeadLatentAttention : public SelfAttention {
 public:
  MultiHeadLatentAttention(int64_t dim, const MLAOptions& options, const torch::TensorOptions& tensor_options);

  // x [B, T, dim]; rope_cache [2, >=T, qk_rope_head_dim], indexed by the layout's positions.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cache, const TokenLayout& layout = {});

  const MLAOptions& options() const { return options_; }
  int64_t qk_head_dim() const { return options_.qk_nope_head_dim + options_.qk_rope_head_dim; }

 private:
  MLAOptions options_;
  std::shared_ptr<Linear> wq_;    // q_lora_rank = 0
  std::shared_ptr<Linear> wq_a_;  // q_lora_rank > 0
  std::shared_ptr<RMSNorm> q_norm_;
  std::shared_ptr<Linear> wq_b_;
  std::shared_ptr<Linear> wkv_a_;
  std::shared_ptr<RMSNorm> kv_norm_;
  std::shared_ptr<Linear> wkv_b_;
  std::shared_ptr<Linear> wo_;
};

// DeepSeek's interleaved pairs to the rotate-half layout along the last dim: [x0, x2, ..., x1, x3, ...].
torch::Tensor deinterleave_pairs(const torch::Tensor& x);

}  // namespace loom::nn
