// Causal grouped-query self-attention with rotary embeddings, through
// at::scaled_dot_product_attention (flash kernel on CPU and CUDA). Key/value heads are shared by
// n_heads / n_kv_heads query heads via SDPA's enable_gqa, so K and V are never repeated in memory.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>

#include "loom/nn/layers.h"
#include "loom/nn/module.h"

namespace loom::nn {

class Attention : public Module {
 public:
  // head_dim = dim / n_heads; n_heads must be a multiple of n_kv_heads.
  Attention(int64_t dim, int64_t n_heads, int64_t n_kv_heads, const torch::TensorOptions& options);

  // x: [B, T, dim]; rope_cache: [2, >=T, head_dim] (loom/nn/rope.h). Returns [B, T, dim].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cache);

  // The steps of forward, separately callable (a fused-kernel path replaces them one at a time).
  // Projects x to q [B, T, H, D] and k, v [B, T, KV, D].
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> project_qkv(const torch::Tensor& x);
  // q [B, T, H, D], k/v [B, T, KV, D] (after RoPE) -> attention output [B, T, H * D].
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) const;

  Linear& wq() { return *wq_; }
  Linear& wk() { return *wk_; }
  Linear& wv() { return *wv_; }
  Linear& wo() { return *wo_; }
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
};

}  // namespace loom::nn
