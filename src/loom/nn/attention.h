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

// The general mask (true = may attend) of queries at `q_positions` [Tq] against keys at
// `k_positions` [Tk] (int64, positions in the whole sequence): causal (key position <= query
// position); with `sliding_window` > 0 also query - key < sliding_window (Hugging Face's
// sliding_window_overlay: a query sees itself and the window - 1 tokens before it); with
// `q_documents` [B, Tq] and `k_documents` [B, Tk] (undefined: none) only keys of the query's own
// document. [B or 1, 1, Tq, Tk].
torch::Tensor attention_mask(const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                             int64_t sliding_window = 0, const torch::Tensor& q_documents = torch::Tensor(),
                             const torch::Tensor& k_documents = torch::Tensor());

// Attention with sinks (GPT-OSS): q [B, H, Tq, D], k and v [B, KV, Tk, D] (KV divides H), `sinks`
// [H] one logit per query head that joins every query row's softmax denominator with no value:
// out = sum_j exp(s_j - L') v_j with L' = log(exp(sink) + sum_j exp(s_j)), s_j = q.k_j / sqrt(D)
// over the allowed keys. `mask` (bool, broadcastable to [B, H, Tq, Tk], true = may attend) or
// `causal` (keys 0..Tq-1 causal; Tq == Tk) says which keys are allowed; every query row must allow
// at least one key. Differentiable in q, k, v and sinks. CPU: libtorch's flash kernel with its
// log-sum-exp L (out = flash_out * sigmoid(L - sink)), its backward run on the sink-corrected output
// and log-sum-exp; CUDA in bf16 / fp16, causal or unmasked: the same over CUDA's flash kernel
// (tests/cuda/kernels/test_cuda_sink_attention.cpp); otherwise explicit softmax in float32.
torch::Tensor sink_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::optional<torch::Tensor>& mask, bool causal, const torch::Tensor& sinks);

// What a layer's attention core computes beyond the (block-)causal mask, handed to every core
// (the built-in one and those installed from outside: context parallel, the KV cache, activation
// checkpointing). Default: plain attention.
struct AttendFeatures {
  // [heads] (this rank's query heads under tensor parallelism): GPT-OSS's learned attention sinks,
  // one extra logit per head in each softmax denominator; undefined: none.
  torch::Tensor sinks;
  // > 0: sliding-window attention, a query at position i sees keys at positions j with
  // i - sliding_window < j <= i (Hugging Face's convention); 0: every earlier key.
  int64_t sliding_window = 0;
};

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
  // GPT-OSS. Learned attention sinks: a parameter "sinks" [n_heads] (one logit per query head in
  // every softmax denominator, no value; the family initializes it by name, e.g. normal). Under
  // tensor parallelism it is sharded along heads like wq's output (TPStyle::kHeadwise).
  bool sinks = false;
  // > 0: this layer attends within a sliding window of that many tokens (the query's own
  // included); 0: full causal. A family sets it per layer (GPT-OSS: layer_types).
  int64_t sliding_window = 0;
  // Biases on wq, wk, wv and wo ("wq.bias", ...; attention_bias).
  bool bias = false;
};

// What every self-attention of a decoder shares: the attention core between the projections and
// the output projection, which parallelisms and generation replace from outside (context parallel's
// ring attention, the KV cache). Its contract: q [B, T, H, Dqk], k [B, T, KV, Dqk], v [B, T, KV, Dv]
// (after RoPE; KV divides H) -> [B, T, H * Dv], causal (or block-causal by the layout's documents),
// softmax scale 1 / sqrt(Dqk), with the layer's features (sinks, sliding window: AttendFeatures).
// A variant with another scale folds it into q.
class SelfAttention : public Module {
 public:
  using Module::Module;

  // The installed core, else the built-in SDPA one.
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const TokenLayout& layout = {}) const;
  // Replaces the attention core (same contract as attend, the layer's features passed in): a
  // parallelism whose keys live on other ranks (context parallel's ring attention) installs its
  // own from outside.
  using AttendFn = std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v, const TokenLayout& layout,
                                               const AttendFeatures& features)>;
  void set_attend(AttendFn attend) { attend_ = std::move(attend); }
  // The installed core (null: scaled_dot_product_attention), so a wrapper can chain to it.
  const AttendFn& attend_fn() const { return attend_; }
  // The built-in core (what attend runs without an installed one): causal or block-causal SDPA.
  // With a sliding window, queries are taken in chunks of kWindowChunk (or the window, if larger)
  // tokens, each against only the keys its window reaches, once the row is longer than two chunks:
  // the blocks wholly outside the window are never computed.
  torch::Tensor sdpa_attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const TokenLayout& layout = {}, const AttendFeatures& features = {}) const;
  static constexpr int64_t kWindowChunk = 128;

  // This layer's features as the core sees them now (the sinks slot's current tensor: this rank's
  // heads under TP, FSDP's unsharded parameter during forward).
  AttendFeatures features() const;
  bool has_sinks() const { return sinks_ != nullptr; }
  int64_t sliding_window() const { return sliding_window_; }

 protected:
  // For the variants' constructors: registers parameter "sinks" [heads] (uninitialized, as every
  // parameter until init_weights) and sets the window.
  void enable_sinks(int64_t heads, const torch::TensorOptions& options);
  void set_sliding_window(int64_t window);

 private:
  AttendFn attend_;
  ParameterSlot* sinks_ = nullptr;
  int64_t sliding_window_ = 0;
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
  bool has_bias() const { return wq_->has_bias(); }
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
