// Token-choice top-k routing (TorchTitan's TokenChoiceTopKRouter, DeepSeek-V3's and Qwen3-MoE's
// gates): every token picks `top_k` experts from scores over all of them.
//
//   logits  = x W^T (+ b when the gate has a bias: GPT-OSS), in float32
//   scores  = softmax(logits) or sigmoid(logits); or, for GPT-OSS (kSoftmaxAfterTopK), the raw
//             logits themselves
//   choice  = scores + bias (the selection bias of auxiliary-loss-free balancing: it changes which
//             experts are picked, never the weights); with groups, only the `topk_groups` groups
//             of experts with the largest sums of their two best choice scores stay eligible
//   experts = top_k(choice), weights = scores at those experts (unbiased), divided by their sum
//             when `normalize` (Qwen3-MoE's norm_topk_prob, DeepSeek's route_norm), times `scale`;
//             kSoftmaxAfterTopK: weights = softmax over the k selected (unbiased) logits
//             (transformers' GptOssTopKRouter: top-k first, then the softmax; the k weights
//             already sum to 1, so `normalize` changes nothing). Without a selection bias this
//             equals softmax-then-normalize (TorchTitan's GPT-OSS router) up to rounding; with
//             one, the bias is added to the logits rather than to the probabilities.
#pragma once
#include <torch/torch.h>

#include <cstdint>

#include "loom/core/options.h"
#include "loom/nn/layers.h"
#include "loom/nn/module.h"

namespace loom::moe {

// kSoftmaxAfterTopK ("softmax_topk"): GPT-OSS's order, see above.
enum class ScoreFunction { kSoftmax, kSigmoid, kSoftmaxAfterTopK };
const options::EnumNames<ScoreFunction>& option_names(ScoreFunction);

struct RouterOptions {
  int64_t n_experts = 8;
  int64_t top_k = 2;
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  bool normalize = false;  // the k weights divided by their sum
  double scale = 1.0;      // route_scale
  int64_t n_groups = 1;    // > 1: group-limited routing over n_experts / n_groups experts a group
  int64_t topk_groups = 1;
  bool gate_bias = false;  // the gate Linear has a bias [E] ("gate.bias", GPT-OSS's router.bias)

  // A one-line loom::UsageError naming the first inconsistent field.
  void validate() const;
};

// What the router decided for N tokens.
struct Routing {
  torch::Tensor weights;  // [N, K] float32
  torch::Tensor experts;  // [N, K] int64, each row's experts in descending choice order
  torch::Tensor counts;   // [E] int64, on the logits' device: how many (token, choice) pairs went to each expert
};

// The routing of `logits` [N, E] (any floating dtype; the math runs in float32). `bias` [E]
// (float32) or undefined: the selection bias.
Routing route(const torch::Tensor& logits, const RouterOptions& options, const torch::Tensor& bias = {});

// The router's gate: logits = x W^T (+ b) with W [E, dim] ("gate.weight") and, with gate_bias,
// b [E] ("gate.bias"), then route().
class Router : public nn::Module {
 public:
  Router(int64_t dim, RouterOptions options, const torch::TensorOptions& tensor_options);
  // x [N, dim] -> the routing of its tokens.
  Routing forward(const torch::Tensor& x, const torch::Tensor& bias = {});
  nn::Linear& gate() { return *gate_; }
  const RouterOptions& options() const { return options_; }

 private:
  RouterOptions options_;
  std::shared_ptr<nn::Linear> gate_;
};

}  // namespace loom::moe
