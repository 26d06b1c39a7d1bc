#include "loom/nn/mla.h"

#include "loom/core/error.h"
#include "loom/nn/rope.h"

namespace loom::nn {

MultiHeadLatentAttention::MultiHeadLatentAttention(int64_t dim, const MLAOptions& o,
                                                   const torch::TensorOptions& tensor_options)
    : SelfAttention("MultiHeadLatentAttention"), options_(o) {
  LOOM_REQUIRE(o.n_heads > 0 && o.kv_lora_rank > 0 && o.qk_nope_head_dim > 0 && o.qk_rope_head_dim > 0 &&
                   o.qk_rope_head_dim % 2 == 0 && o.v_head_dim > 0 && o.q_lora_rank >= 0,
               "multi-head latent attention needs positive heads, kv_lora_rank, head widths (an even rope "
               "width) and q_lora_rank >= 0");
  const int64_t qk = qk_head_dim();
  if (o.q_lora_rank == 0) {
    wq_ = register_module("wq", std::make_shared<Linear>(dim, o.n_heads * qk, tensor_options));
  } else {
    wq_a_ = register_module("wq_a", std::make_shared<Linear>(dim, o.q_lora_rank, tensor_options));
    q_norm_ = register_module("q_norm", std::make_shared<RMSNorm>(o.q_lora_rank, o.norm_eps, tensor_options));
    wq_b_ = register_module("wq_b", std::make_shared<Linear>(o.q_lora_rank, o.n_heads * qk, tensor_options));
  }
  wkv_a_ = register_module("wkv_a", std::make_shared<Linear>(dim, o.kv_lora_rank + o.qk_rope_head_dim, tensor_options));
  kv_norm_ = register_module("kv_norm", std::make_shared<RMSNorm>(o.kv_lora_rank, o.norm_eps, tensor_options));
  wkv_b_ = register_module(
      "wkv_b", std::make_shared<Linear>(o.kv_lora_rank, o.n_heads * (o.qk_nope_head_dim + o.v_head_dim), tensor_options));
  wo_ = register_module("wo", std::make_shared<Linear>(o.n_heads * o.v_head_dim, dim, tensor_options));
}

torch::Tensor deinterleave_pairs(const torch::Tensor& x) {
  using torch::indexing::None;
  using torch::indexing::Slice;
  return torch::cat({x.index({"...", Slice(0, None, 2)}), x.index({"...", Slice(1, None, 2)})}, -1);
}

torch::Tensor MultiHeadLatentAttention::forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                                                const TokenLayout& layout) {
  return call_with_hooks(x, [&](const torch::Tensor& in) {
    const MLAOptions& o = options_;
    const int64_t batch = in.size(0), seq = in.size(1), qk = qk_head_dim();
    const torch::Tensor rope = layout.positions.defined() ? rope_cache.index_select(1, layout.positions) : rope_cache;
    auto rotate = [&](torch::Tensor part) {
      if (o.rope_interleave) part = deinterleave_pairs(part);
      return apply_rotary_embedding(part.contiguous(), rope);
    };
    // Queries: this rank's heads (the projection's output width says how many).
    torch::Tensor q = wq_ ? wq_->forward(in) : wq_b_->forward(q_norm_->forward(wq_a_->forward(in)));
    q = q.view({batch, seq, -1, qk});
    const int64_t heads = q.size(2);
    torch::Tensor q_rope = rotate(q.narrow(-1, o.qk_nope_head_dim, o.qk_rope_head_dim));
    // The latent and the shared rope key.
    const torch::Tensor latent = wkv_a_->forward(in);
    const torch::Tensor c = kv_norm_->forward(latent.narrow(-1, 0, o.kv_lora_rank));
    const torch::Tensor k_rope =
        rotate(latent.narrow(-1, o.kv_lora_rank, o.qk_rope_head_dim).view({batch, seq, 1, o.qk_rope_head_dim}));
    const torch::Tensor kv = wkv_b_->forward(c).view({batch, seq, heads, o.qk_nope_head_dim + o.v_head_dim});
    const torch::Tensor k =
        torch::cat({kv.narrow(-1, 0, o.qk_nope_head_dim), k_rope.expand({batch, seq, heads, o.qk_rope_head_dim})}, -1);
    const torch::Tensor v = kv.narrow(-1, o.qk_nope_head_dim, o.v_head_dim);
    q = torch::cat({q.narrow(-1, 0, o.qk_nope_head_dim), q_rope}, -1);
    if (o.softmax_scale != 1.0) q = q * o.softmax_scale;
    return wo_->forward(attend(q, k, v.contiguous(), layout));
  });
}

}  // namespace loom::nn
