// The routed experts: E SwiGLU feed-forwards with their weights stacked, w1 and w3 [E, hidden,
// dim], w2 [E, dim, hidden] (TorchTitan's GroupedExperts; expert e computes
// w2[e] (silu(w1[e] x) * w3[e] x)). Stacked weights are what expert parallelism shards (dim 0) and
// what FSDP's planner keeps whole per expert.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "loom/nn/module.h"

namespace loom::moe {

class GroupedExperts : public nn::Module {
 public:
  GroupedExperts(int64_t n_experts, int64_t dim, int64_t hidden_dim, const torch::TensorOptions& options);

  // x [M, dim]: tokens sorted by expert, counts[e] of them for expert e (in expert order, summing
  // to M) -> [M, dim], row for row. An expert with no tokens computes nothing; its weights still
  // get (zero) gradients, as does every weight when M is 0, so every rank's gradients have the
  // same parameters whatever its tokens.
  torch::Tensor forward(const torch::Tensor& x, const std::vector<int64_t>& counts);

  const torch::Tensor& w1() const { return w1_->tensor; }
  const torch::Tensor& w2() const { return w2_->tensor; }
  const torch::Tensor& w3() const { return w3_->tensor; }
  int64_t n_experts() const { return n_experts_; }
  int64_t hidden_dim() const { return hidden_dim_; }

 private:
  int64_t n_experts_, dim_, hidden_dim_;
  nn::ParameterSlot* w1_;
  nn::ParameterSlot* w2_;
  nn::ParameterSlot* w3_;
};

}  // namespace loom::moe
