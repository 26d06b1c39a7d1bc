#include "loom/nn/layers.h"

#include "loom/core/error.h"
#include "loom/nn/fused.h"

namespace loom::nn {

Linear::Linear(int64_t in_features, int64_t out_features, const torch::TensorOptions& options,
               bool bias)
    : Module("Linear"), in_features_(in_features), out_features_(out_features) {
  TORCH_CHECK(in_features > 0 && out_features > 0, "Linear needs positive sizes, got ",
              in_features, "x", out_features);
  weight_ = register_parameter("weight", torch::empty({out_features, in_features}, options));
  if (bias) bias_ = register_parameter("bias", torch::empty({out_features}, options));
}

torch::Tensor Linear::apply(const torch::Tensor& x) const {
  return adds_bias() ? at::linear(x, weight_->tensor, bias_->tensor)
                          : at::linear(x, weight_->tensor);
}

torch::Tensor Linear::forward(const torch::Tensor& x) {
  return call_with_hooks(x, [this](const torch::Tensor& in) { return apply(in); });
}

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim,
                     const torch::TensorOptions& options)
    : Module("Embedding"), num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {
  TORCH_CHECK(num_embeddings > 0 && embedding_dim > 0, "Embedding needs positive sizes");
  weight_ = register_parameter("weight", torch::empty({num_embeddings, embedding_dim}, options));
}

torch::Tensor Embedding::forward(const torch::Tensor& ids) {
  return call_with_hooks(ids, [this](const torch::Tensor& in) {
    return at::embedding(weight_->tensor, in);
  });
}

RMSNorm::RMSNorm(int64_t dim, double eps, const torch::TensorOptions& options)
    : Module("RMSNorm"), dim_(dim), eps_(eps) {
  TORCH_CHECK(dim > 0 && eps > 0, "RMSNorm needs dim > 0 and eps > 0");
  weight_ = register_parameter("weight", torch::empty({dim}, options));
}

torch::Tensor RMSNorm::forward(const torch::Tensor& x) {
  return call_with_hooks(x, [this](const torch::Tensor& in) {
    return fused_rms_norm(in, weight_->tensor, eps_);
  });
}

std::pair<torch::Tensor, torch::Tensor> RMSNorm::add_and_forward(const torch::Tensor& residual,
                                                                 const torch::Tensor& delta) {
  if (has_forward_hooks()) {
    torch::Tensor sum = residual + delta;
    torch::Tensor normed = forward(sum);
    return {sum, normed};
  }
  return fused_add_rms_norm(residual, delta, weight_->tensor, eps_);
}

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  // One pass forward and one backward (loom/nn/fused.h); saves gate and up only.
  return fused_swiglu(gate, up);
}

FeedForward::FeedForward(int64_t dim, int64_t hidden_dim, const torch::TensorOptions& options)
    : Module("FeedForward"), hidden_dim_(hidden_dim) {
  w1_ = register_module("w1", std::make_shared<Linear>(dim, hidden_dim, options));
  w2_ = register_module("w2", std::make_shared<Linear>(hidden_dim, dim, options));
  w3_ = register_module("w3", std::make_shared<Linear>(dim, hidden_dim, options));
}

torch::Tensor FeedForward::forward(const torch::Tensor& x) {
  return call_with_hooks(x, [this](const torch::Tensor& in) {
    return w2_->forward(swiglu(w1_->forward(in), w3_->forward(in)));
  });
}

}  // namespace loom::nn
