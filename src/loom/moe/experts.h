// The routed experts: E SwiGLU feed-forwards with their weights stacked, w1 and w3 [E, hidden,
// dim], w2 [E, dim, hidden] (TorchTitan's GroupedExperts; expert e computes
// w2[e] (silu(w1[e] x) * w3[e] x)). Stacked weights are what expert parallelism shards (dim 0) and
// what FSDP's planner keeps whole per expert.
//
// GPT-OSS's experts (ExpertsOptions) add, per expert, biases b1 and b3 [E, hidden] (the gate's and
// the up projection's) and b2 [E, dim] (the down projection's, added to every routed (token,
// expert) row before the MoE layer weights it), stacked like the weights (expert parallelism
// shards them with their experts, FSDP keeps them whole per expert), and the clamped SwiGLU
//   g = min(w1 x + b1, limit), u = clamp(w3 x + b3, -limit, limit), h = (u + 1) g sigmoid(alpha g)
// (transformers' GptOssExperts._apply_gate; alpha 1.702, limit 7). The biases stay in the
// parameters' dtype (no float8: the expert GEMMs are not converted).
//
// Storage of GPT-OSS's fused gate_up_proj: Loom keeps the gate and up projections apart, as w1 and
// w3 [E, hidden, dim] like every other family (so expert parallelism, FSDP, checkpoints and the
// other families' HF mappings see the same three stacks). transformers stores gate_up_proj
// [E, dim, 2 hidden] with the gate and up columns INTERLEAVED (gate = [..., ::2], up = [..., 1::2])
// and gate_up_proj_bias [E, 2 hidden] alike, down_proj [E, hidden, dim] (transposed against w2);
// split_interleaved_gate_up() and its inverses below are that mapping, for the HF adapter.
//
// The three GEMMs of all experts are grouped GEMMs (at::_grouped_mm: one call over the token rows
// cut at the experts' offsets) where the device allows: on the CPU for any floating dtype, on
// CUDA for bfloat16, with both expert dims a multiple of 16 bytes (its alignment). Elsewhere, or with
// set_grouped_mm(false), a loop of two GEMMs and one per expert over its rows. Both give the same
// values (the CPU kernel runs the same per-group GEMMs).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "loom/nn/module.h"

namespace loom::moe {

enum class ExpertActivation {
  kSwiGLU,         // silu(w1 x) * (w3 x)
  kClampedSwiGLU,  // GPT-OSS's, above
};

struct ExpertsOptions {
  bool bias = false;  // b1, b3 [E, hidden] and b2 [E, dim]
  ExpertActivation activation = ExpertActivation::kSwiGLU;
  double swiglu_alpha = 1.702;  // kClampedSwiGLU: g sigmoid(alpha g)
  double swiglu_limit = 7.0;    // kClampedSwiGLU: the clamp of g (above) and u (both sides)

  // A one-line loom::UsageError naming the first inconsistent field.
  void validate() const;
};

// The activation of the gate projection `gate` and the up projection `up` (same shapes).
torch::Tensor expert_activation(const torch::Tensor& gate, const torch::Tensor& up, const ExpertsOptions& options);

// transformers' GptOssExperts layout <-> Loom's. `gate_up` [E, dim, 2 hidden] (interleaved columns)
// -> {w1, w3} [E, hidden, dim] each; `gate_up_bias` [E, 2 hidden] -> {b1, b3} [E, hidden]; `down`
// [E, hidden, dim] -> w2 [E, dim, hidden]. The results are contiguous copies; the inverses give
// back the HF tensors exactly.
std::pair<torch::Tensor, torch::Tensor> split_interleaved_gate_up(const torch::Tensor& gate_up);
torch::Tensor interleave_gate_up(const torch::Tensor& w1, const torch::Tensor& w3);
std::pair<torch::Tensor, torch::Tensor> split_interleaved_gate_up_bias(const torch::Tensor& gate_up_bias);
torch::Tensor interleave_gate_up_bias(const torch::Tensor& b1, const torch::Tensor& b3);
torch::Tensor down_proj_to_w2(const torch::Tensor& down);
torch::Tensor w2_to_down_proj(const torch::Tensor& w2);

class GroupedExperts : public nn::Module {
 public:
  GroupedExperts(int64_t n_experts, int64_t dim, int64_t hidden_dim, const torch::TensorOptions& options,
                 ExpertsOptions experts_options = {});

  // x [M, dim]: tokens sorted by expert, counts[e] of them for expert e (in expert order, summing
  // to M) -> [M, dim], row for row. An expert with no tokens computes nothing; its weights still
  // get (zero) gradients, as does every weight when M is 0, so every rank's gradients have the
  // same parameters whatever its tokens.
  // `counts` [local experts] int64 on any device. The grouped GEMM path keeps them where they are
  // (the offsets are their cumulative sum there): with counts on the GPU it reads nothing on the
  // host, so a CUDA step does not wait here. The per-expert loop reads them on the host.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& counts);
  // The same with counts on the host.
  torch::Tensor forward(const torch::Tensor& x, const std::vector<int64_t>& counts);

  // Whether forward may use at::_grouped_mm (default true; false forces the per-expert loop).
  void set_grouped_mm(bool enabled) { grouped_mm_ = enabled; }
  // Whether at::_grouped_mm takes these tokens and weights (device, dtype, alignment).
  static bool grouped_mm_supported(const torch::Tensor& x, const torch::Tensor& w);

  const torch::Tensor& w1() const { return w1_->tensor; }
  const torch::Tensor& w2() const { return w2_->tensor; }
  const torch::Tensor& w3() const { return w3_->tensor; }
  // Undefined without ExpertsOptions::bias.
  torch::Tensor b1() const { return b1_ != nullptr ? b1_->tensor : torch::Tensor(); }
  torch::Tensor b2() const { return b2_ != nullptr ? b2_->tensor : torch::Tensor(); }
  torch::Tensor b3() const { return b3_ != nullptr ? b3_->tensor : torch::Tensor(); }
  const ExpertsOptions& options() const { return options_; }
  // Every parameter stacked by expert (dim 0 = expert): w1, w2, w3 and, with biases, b1, b2, b3.
  std::vector<std::string> stacked_parameter_names() const;
  int64_t n_experts() const { return n_experts_; }
  int64_t hidden_dim() const { return hidden_dim_; }

 private:
  int64_t n_experts_, dim_, hidden_dim_;
  ExpertsOptions options_;
  bool grouped_mm_ = true;
  nn::ParameterSlot* w1_;
  nn::ParameterSlot* w2_;
  nn::ParameterSlot* w3_;
  nn::ParameterSlot* b1_ = nullptr;
  nn::ParameterSlot* b2_ = nullptr;
  nn::ParameterSlot* b3_ = nullptr;
};

}  // namespace loom::moe
