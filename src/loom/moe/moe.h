// The Mixture-of-Experts feed-forward (TorchTitan's MoE module): every token is routed to top_k of
// n_experts SwiGLU experts and gets the routing-weighted sum of their outputs, plus, when the
// family has them, shared experts (a dense SwiGLU every token passes through).
//
//   route      Router over the tokens (with the selection bias `expert_bias` when balancing)
//   permute    the (token, choice) pairs stably sorted by expert, so each expert's tokens are
//              contiguous (ties keep token order: the same routing gives the same rows)
//   experts    GroupedExperts on the sorted rows
//   combine    each output times its routing weight in float32, gathered back to (token, choice)
//              order and summed over the choices in choice order: deterministic, no atomics
//
// GPT-OSS's options (a family turns them on in the MoEOptions its args give): router.gate_bias
// with router.score_function = kSoftmaxAfterTopK (router.h), and experts.bias with
// experts.activation = kClampedSwiGLU (experts.h); the down projection's bias b2 is added per
// (token, expert) row before the routing weight multiplies it, as transformers' GptOssExperts does.
//
// Names: router.gate.weight [, router.gate.bias], experts.{w1,w2,w3} [, experts.{b1,b2,b3}],
// shared_experts.{w1,w2,w3}.weight (when present),
// buffers expert_bias [E] (float32, saved) and tokens_per_expert [E] (float32, the counts since the
// last balancing step; not saved).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "loom/moe/experts.h"
#include "loom/moe/router.h"
#include "loom/nn/layers.h"
#include "loom/nn/module.h"

namespace loom::moe {

struct MoEOptions {
  RouterOptions router;
  int64_t hidden_dim = 0;         // each routed expert's hidden width (moe_intermediate_size)
  int64_t shared_hidden_dim = 0;  // the shared experts' width; 0 = none
  ExpertsOptions experts;         // the routed experts' biases and activation (GPT-OSS's)
  // Auxiliary-loss-free balancing (DeepSeek-V3): > 0 keeps the selection bias and moves it by this
  // much per balancing step (balance_experts()); 0 = no bias.
  double load_balance_coeff = 0.0;
};

// How the permuted tokens reach the routed experts: `rows` [M, dim] sorted by expert, counts[e]
// of them for each of the n_experts experts (global ids; [E] int64 on the rows' device) -> the
// experts' outputs for the same rows in the same order. The default calls the experts in place,
// reading no count on the host (a CUDA step runs without a synchronisation here); expert
// parallelism (ep/) replaces it with a dispatch to the ranks that hold them and back, which needs
// the counts on the host (the all-to-all's split sizes).
using ExpertCompute =
    std::function<torch::Tensor(GroupedExperts& experts, const torch::Tensor& rows, const torch::Tensor& counts)>;

class MoE : public nn::Module {
 public:
  MoE(int64_t dim, MoEOptions options, const torch::TensorOptions& tensor_options);

  // x [..., dim] -> [..., dim]. With gradients enabled (a training forward) adds this call's
  // per-expert token counts to tokens_per_expert.
  torch::Tensor forward(const torch::Tensor& x);

  // Replaces how the sorted tokens reach the experts (see ExpertCompute); applied from outside.
  void set_expert_compute(ExpertCompute compute) { expert_compute_ = std::move(compute); }

  Router& router() { return *router_; }
  GroupedExperts& experts() { return *experts_; }
  bool has_shared_experts() const { return shared_experts_ != nullptr; }
  nn::FeedForward& shared_experts() { return *shared_experts_; }
  const MoEOptions& options() const { return options_; }
  // Undefined without load balancing.
  torch::Tensor expert_bias() const { return expert_bias_ != nullptr ? expert_bias_->tensor : torch::Tensor(); }
  const torch::Tensor& tokens_per_expert() const { return tokens_per_expert_->tensor; }

  // One balancing step (before the optimizer step): `counts` [E] are the tokens each expert got
  // since the last step, summed over every rank that routed a share of the batch (data and context
  // parallel ranks); bias += coeff * sign(mean(counts) - counts), re-centred to mean 0. Resets
  // tokens_per_expert. No-op without load balancing.
  void balance_experts(const torch::Tensor& counts);
  // Zeroes tokens_per_expert without moving the bias (a frozen base's layer: the loads are
  // measured, the routing stays as loaded).
  void reset_load_counts();
  // Zeroes the routing state (the selection bias and the counts) where the buffers now live.
  void reset_state();

 private:
  MoEOptions options_;
  std::shared_ptr<Router> router_;
  std::shared_ptr<GroupedExperts> experts_;
  std::shared_ptr<nn::FeedForward> shared_experts_;
  ExpertCompute expert_compute_;  // empty: the experts on this rank, in place
  nn::BufferSlot* expert_bias_ = nullptr;
  nn::BufferSlot* tokens_per_expert_ = nullptr;
};

// The balancing rule on its own: the bias update for per-expert token counts `counts` [E].
torch::Tensor expert_bias_update(const torch::Tensor& counts, double coeff);

}  // namespace loom::moe
