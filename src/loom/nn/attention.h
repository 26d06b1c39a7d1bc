// Causal grouped-query self-attention with rotary embeddings, through
// at::scaled_dot_product_attention (flash kernel on CPU and CUDA); SelfAttention is the part every
// attention variant shares (the replaceable core; nn/mla.h is the other variant). Key/value heads are shared by
// n_heads / n_kv_heads query heads via SDPA's enable_gqa, so K and V are never repeated in memory.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>

#include "loom/core/options.h"
#include "loom/nn/layers.h"
#include "loom/nn/module.h"

namespace loom::nn {

// Where a batch's tokens sit, as attention needs it: the model passes it, unchanged, to every
// block. Default-constructed: each row is one sequence 0..T-1 under a causal mask.
struct TokenLayout {
  // [T] int64: each token's position in its sequence (RoPE). Context parallelism gives each rank
  // non-contiguous chunks of the sequence; undefined means 0..T-1.
  torch::Tensor positions;
  // [B, T] int64: the document each token belongs to. A token attends only to earlier tokens of
  // its own document (block-causal masking of packed rows); undefined means causal over the row.
  torch::Tensor document_ids;
};

// Block-causal attention mask [B, 1, T, T] (true = may attend) of `document_ids` [B, T] for
// tokens at positions 0..T-1.
torch::Tensor block_causal_mask(const torch::Tensor& document_ids);

// model.attention_mask: which earlier tokens a token attends to.
enum class AttentionMask {
  kCausal,       // every earlier token of its row
  kBlockCausal,  // only those of its own document (TokenLayout::document_ids)
};
// "causal" | "block_causal" (core/options.h's enum protocol).
const options::EnumNames<AttentionMask>& option_names(AttentionMask);

// The variants of attention the model families use, beside the head counts.
struct AttentionOptions {
  // Width of a head; 0: dim / n_heads (Llama). Qwen3 decouples it (e.g. 128 with dim 1024, 16 heads).
  int64_t head_dim = 0;
  // QK-norm (Qwen3, OLMo 2): an RMSNorm over head_dim, one weight shared by all heads, applied to
  // each query and key head before RoPE ("q_norm", "k_norm"); unset: none.
  std::optional<double> qk_norm_eps;
};

// What every self-attention of a decoder shares: the attention core between the projections and
// the output projection, which parallelisms and generation replace from outside (context parallel's
// ring attention, the KV cache). Its contract: q [B, T, H, Dqk], k [B, T, KV, Dqk], v [B, T, KV, Dv]
// (after RoPE; KV divides H) -> [B, T, H * Dv], causal (or block-causal by the layout's documents),
// softmax scale 1 / sqrt(Dqk). A variant with another scale folds it into q.
class SelfAttention : public Module {
 public:
  using Module::Module;

  // The installed core, else the built-in SDPA one.
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const TokenLayout& layout = {}) const;
  // Replaces the attention core (same contract as attend): a parallelism whose keys live on
  // other ranks (context parallel's ring attention) installs its own from outside.
  using AttendFn = std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v, const TokenLayout& layout)>;
  void set_attend(AttendFn attend) { attend_ = std::move(attend); }
  // The installed core (null: scaled_dot_product_attention), so a wrapper can chain to it.
  const AttendFn& attend_fn() const { return attend_; }
  // The built-in core (what attend runs without an installed one): causal or block-causal SDPA.
  torch::Tensor sdpa_attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const TokenLayout& layout = {}) const;

 private:
  AttendFn attend_;
};

class Attention : public SelfAttention {
 public:
  // n_heads must be a multiple of n_kv_heads; without options.head_dim, dim of n_heads.
  Attention(int64_t dim, int64_t n_heads, int64_t n_kv_heads, const torch::TensorOptions& options,
            const AttentionOptions& variant = {});

  // x: [B, T, dim]; rope_cache: [2, >=T, head_dim] (loom/nn/rope.h), indexed by the layout's
  // positions. Returns [B, T, dim].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cache, const TokenLayout& layout = {});

  // The steps of forward, separately callable (a fused-kernel path replaces them one at a time).
  // Projects x to q [B, T, H, D] and k, v [B, T, KV, D] (q and k through the QK-norm when present).
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> project_qkv(const torch::Tensor& x);

  Linear& wq() { return *wq_; }
  Linear& wk() { return *wk_; }
  Linear& wv() { return *wv_; }
  Linear& wo() { return *wo_; }
  bool has_qk_norm() const { return q_norm_ != nullptr; }
  int64_t n_heads() const { return n_heads_; }
  int64_t n_kv_heads() const { return n_kv_heads_; }
  int64_t head_dim() const { return head_dim_; }

 private:
  int64_t n_heads_;
  int64_t n_kv_heads_;
  int64_t head_dim_;
  std::shared_ptr<Linear> wq_;
  std::shared_ptr<Linear> wk_;
  std::shared_ptr<Linear> wv_;
  std::shared_ptr<Linear> wo_;
  std::shared_ptr<RMSNorm> q_norm_;  // null without QK-norm
  std::shared_ptr<RMSNorm> k_norm_;
};

}  // namespace loom::nn
