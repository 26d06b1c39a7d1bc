// Basic single-device layers. Each reads its parameters through its slots on every call (so a
// parallelism wrapper may swap them) and routes its input through the module's forward hooks.
// Parameters are created with the given TensorOptions, including the meta device (no memory);
// values are left uninitialized: the model initializes every parameter by name (loom/nn/init.h).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>

#include "loom/nn/module.h"

namespace loom::nn {

// y = x W^T (+ b). No bias by default: Llama has none.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, const torch::TensorOptions& options,
         bool bias = false);
  torch::Tensor forward(const torch::Tensor& x);
  // The math without hooks, for callers that fuse around it.
  torch::Tensor apply(const torch::Tensor& x) const;

  const torch::Tensor& weight() const { return weight_->tensor; }  // [out, in]
  bool has_bias() const { return bias_ != nullptr; }
  // Whether forward (and an override computing the same: float8) adds the bias. Tensor
  // parallelism's rowwise style turns it off and adds the bias once after the ranks' partial sums
  // are reduced (else it would be added once per rank).
  bool adds_bias() const { return bias_ != nullptr && !bias_outside_; }
  void set_bias_outside(bool outside) { bias_outside_ = outside; }
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

 private:
  int64_t in_features_;
  int64_t out_features_;
  ParameterSlot* weight_;
  ParameterSlot* bias_ = nullptr;
  bool bias_outside_ = false;
};

// Token ids (int64, any shape) -> rows of the [num_embeddings, dim] weight.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& ids);
  const torch::Tensor& weight() const { return weight_->tensor; }
  int64_t num_embeddings() const { return num_embeddings_; }
  int64_t embedding_dim() const { return embedding_dim_; }

 private:
  int64_t num_embeddings_;
  int64_t embedding_dim_;
  ParameterSlot* weight_;
};

// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (fused kernel, loom/nn/fused.h;
// at::rms_norm for non-fp32).
class RMSNorm : public Module {
 public:
  RMSNorm(int64_t dim, double eps, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  // (residual + delta, the norm of that sum): a pre-norm block's residual add and the norm after
  // it as one fused op (nn::fused_add_rms_norm). A norm with forward hooks (a parallelism may
  // wrap it) runs the add, then forward(), so the hooks see what they always saw.
  std::pair<torch::Tensor, torch::Tensor> add_and_forward(const torch::Tensor& residual,
                                                          const torch::Tensor& delta);
  const torch::Tensor& weight() const { return weight_->tensor; }
  double eps() const { return eps_; }

 private:
  int64_t dim_;
  double eps_;
  ParameterSlot* weight_;
};

// SwiGLU feed-forward: w2(silu(w1 x) * w3 x). Kept as three separate weights so names map 1:1 to
// Hugging Face's gate_proj / down_proj / up_proj.
class FeedForward : public Module {
 public:
  FeedForward(int64_t dim, int64_t hidden_dim, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x);

  Linear& w1() { return *w1_; }
  Linear& w2() { return *w2_; }
  Linear& w3() { return *w3_; }
  int64_t hidden_dim() const { return hidden_dim_; }

 private:
  int64_t hidden_dim_;
  std::shared_ptr<Linear> w1_;
  std::shared_ptr<Linear> w2_;
  std::shared_ptr<Linear> w3_;
};

// SwiGLU's gate: silu(gate) * up, one fused pass forward and backward (loom/nn/fused.h).
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace loom::nn
