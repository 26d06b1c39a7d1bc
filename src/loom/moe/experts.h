// The routed experts: E SwiGLU feed-forwards with their weights stacked, w1 and w3 [E, hidden,
// dim], w2 [E, dim, hidden] (TorchTitan's GroupedExperts; expert e computes
// w2[e] (silu(w1[e] x) * w3[e] x)). Stacked weights are what expert parallelism shards (dim 0) and
// what FSDP's planner keeps whole per expert.
//
// The three GEMMs of all experts are grouped GEMMs (at::_grouped_mm: one call over the token rows
// cut at the experts' offsets) where the device allows: on the CPU for any floating dtype, on
// CUDA for bfloat16, with both expert dims a multiple of 16 bytes (its alignment). Elsewhere, or with
// set_grouped_mm(false), a loop of two GEMMs and one per expert over its rows. Both give the same
// values (the CPU kernel runs the same per-group GEMMs).
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

  // Whether forward may use at::_grouped_mm (default true; false forces the per-expert loop).
  void set_grouped_mm(bool enabled) { grouped_mm_ = enabled; }
  // Whether at::_grouped_mm takes these tokens and weights (device, dtype, alignment).
  static bool grouped_mm_supported(const torch::Tensor& x, const torch::Tensor& w);

  const torch::Tensor& w1() const { return w1_->tensor; }
  const torch::Tensor& w2() const { return w2_->tensor; }
  const torch::Tensor& w3() const { return w3_->tensor; }
  int64_t n_experts() const { return n_experts_; }
  int64_t hidden_dim() const { return hidden_dim_; }

 private:
  int64_t n_experts_, dim_, hidden_dim_;
  bool grouped_mm_ = true;
  nn::ParameterSlot* w1_;
  nn::ParameterSlot* w2_;
  nn::ParameterSlot* w3_;
};

}  // namespace loom::moe
