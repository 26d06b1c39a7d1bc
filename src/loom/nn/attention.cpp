#include "loom/nn/attention.h"

#include "loom/core/error.h"
#include "loom/nn/rope.h"

namespace loom::nn {

Attention::Attention(int64_t dim, int64_t n_heads, int64_t n_kv_heads,
                     const torch::TensorOptions& options, const AttentionOptions& variant)
    : SelfAttention("Attention"), n_heads_(n_heads), n_kv_heads_(n_kv_heads) {
  LOOM_REQUIRE(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
               "n_heads (", n_heads, ") must be a positive multiple of n_kv_heads (", n_kv_heads,
               ")");
  LOOM_REQUIRE(variant.head_dim > 0 || dim % n_heads == 0, "dim (", dim,
               ") must be divisible by n_heads (", n_heads, ") unless head_dim is given");
  head_dim_ = variant.head_dim > 0 ? variant.head_dim : dim / n_heads;
  wq_ = register_module("wq", std::make_shared<Linear>(dim, n_heads * head_dim_, options));
  wk_ = register_module("wk", std::make_shared<Linear>(dim, n_kv_heads * head_dim_, options));
  wv_ = register_module("wv", std::make_shared<Linear>(dim, n_kv_heads * head_dim_, options));
  wo_ = register_module("wo", std::make_shared<Linear>(n_heads * head_dim_, dim, options));
  if (variant.qk_norm_eps) {
    q_norm_ = register_module("q_norm", std::make_shared<RMSNorm>(head_dim_, *variant.qk_norm_eps, options));
    k_norm_ = register_module("k_norm", std::make_shared<RMSNorm>(head_dim_, *variant.qk_norm_eps, options));
  }
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> Attention::project_qkv(
    const torch::Tensor& x) {
  const int64_t batch = x.size(0);
  const int64_t seq = x.size(1);
  // Linear outputs are contiguous [B, T, heads * D], so these views are free. The head counts come
  // from the projections' outputs: under tensor parallelism each rank's wq/wk/wv hold only its
  // heads, and this module needs to know nothing about it.
  torch::Tensor q = wq_->forward(x);
  torch::Tensor k = wk_->forward(x);
  torch::Tensor v = wv_->forward(x);
  q = q.view({batch, seq, q.size(-1) / head_dim_, head_dim_});
  k = k.view({batch, seq, k.size(-1) / head_dim_, head_dim_});
  v = v.view({batch, seq, v.size(-1) / head_dim_, head_dim_});
  if (q_norm_) {
    // Per head, over head_dim; the weight is the same for every head (so also for this rank's
    // heads under tensor parallelism).
    q = q_norm_->forward(q);
    k = k_norm_->forward(k);
  }
  return {q, k, v};
}

const options::EnumNames<AttentionMask>& option_names(AttentionMask) {
  static const options::EnumNames<AttentionMask> names = {{"causal", AttentionMask::kCausal},
                                                          {"block_causal", AttentionMask::kBlockCausal}};
  return names;
}

torch::Tensor block_causal_mask(const torch::Tensor& document_ids) {
  const int64_t t = document_ids.size(1);
  const torch::Tensor causal = torch::ones({t, t}, document_ids.options().dtype(torch::kBool)).tril();
  return (document_ids.unsqueeze(2) == document_ids.unsqueeze(1)).logical_and(causal).unsqueeze(1);
}

torch::Tensor SelfAttention::attend(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const TokenLayout& layout) const {
  return attend_ ? attend_(q, k, v, layout) : sdpa_attend(q, k, v, layout);
}

torch::Tensor SelfAttention::sdpa_attend(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const TokenLayout& layout) const {
  const int64_t batch = q.size(0);
  const int64_t seq = q.size(1);
  const int64_t heads = q.size(2);  // this rank's query heads (all of them without TP)
  // SDPA wants [B, heads, T, D]; the transposes are strided views the flash kernel reads directly.
  // Positions other than 0..T-1 (a context-parallel shard) need a backend that knows the other
  // ranks' keys; this one sees the whole row.
  LOOM_REQUIRE(!layout.positions.defined(),
               "Attention::attend without a backend needs tokens at positions 0..T-1");
  std::optional<torch::Tensor> mask;
  if (layout.document_ids.defined()) mask = block_causal_mask(layout.document_ids);
  torch::Tensor out = at::scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
      /*dropout_p=*/0.0, /*is_causal=*/!mask.has_value(), /*scale=*/std::nullopt,
      /*enable_gqa=*/heads != k.size(2));
  // The CPU/CUDA flash kernels allocate the output as [B, T, H, D] and return a transposed view,
  // so this reshape is a view, not a copy.
  return out.transpose(1, 2).reshape({batch, seq, heads * v.size(3)});
}

torch::Tensor Attention::forward(const torch::Tensor& x, const torch::Tensor& rope_cache, const TokenLayout& layout) {
  return call_with_hooks(x, [&](const torch::Tensor& in) {
    auto [q, k, v] = project_qkv(in);
    const torch::Tensor rope = layout.positions.defined() ? rope_cache.index_select(1, layout.positions) : rope_cache;
    q = apply_rotary_embedding(q, rope);
    k = apply_rotary_embedding(k, rope);
    return wo_->forward(attend(q, k, v, layout));
  });
}

}  // namespace loom::nn
