#include "loom/moe/router.h"

#include "loom/core/error.h"

namespace loom::moe {

const options::EnumNames<ScoreFunction>& option_names(ScoreFunction) {
  static const options::EnumNames<ScoreFunction> names = {{"softmax", ScoreFunction::kSoftmax},
                                                          {"sigmoid", ScoreFunction::kSigmoid},
                                                          {"softmax_topk", ScoreFunction::kSoftmaxAfterTopK}};
  return names;
}

void RouterOptions::validate() const {
  LOOM_REQUIRE_USAGE(n_experts >= 1, "MoE: n_experts must be >= 1, got ", n_experts);
  LOOM_REQUIRE_USAGE(top_k >= 1 && top_k <= n_experts, "MoE: top_k must be in [1, n_experts = ", n_experts,
                     "], got ", top_k);
  LOOM_REQUIRE_USAGE(n_groups >= 1 && n_experts % n_groups == 0, "MoE: n_groups = ", n_groups,
                     " must divide n_experts = ", n_experts);
  LOOM_REQUIRE_USAGE(topk_groups >= 1 && topk_groups <= n_groups, "MoE: topk_groups must be in [1, n_groups = ",
                     n_groups, "], got ", topk_groups);
  LOOM_REQUIRE_USAGE(n_groups == 1 || (n_experts / n_groups >= 2 && top_k <= topk_groups * (n_experts / n_groups)),
                     "MoE: group-limited routing needs at least 2 experts a group and top_k <= topk_groups x "
                     "experts a group (", topk_groups, " x ", n_experts / n_groups, "), got top_k ", top_k);
}

Routing route(const torch::Tensor& logits, const RouterOptions& o, const torch::Tensor& bias) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) == o.n_experts, "route: logits must be [N, ", o.n_experts,
              "], got ", logits.sizes());
  const torch::Tensor logits32 = logits.to(torch::kFloat);
  const bool after_topk = o.score_function == ScoreFunction::kSoftmaxAfterTopK;
  const torch::Tensor scores = o.score_function == ScoreFunction::kSoftmax   ? logits32.softmax(-1)
                               : o.score_function == ScoreFunction::kSigmoid ? logits32.sigmoid()
                                                                             : logits32;
  // Selection only: no gradient flows through which experts were chosen.
  torch::Tensor choice = scores.detach();
  if (bias.defined()) choice = choice + bias.to(torch::kFloat);
  if (o.n_groups > 1) {
    const int64_t n = choice.size(0), per_group = o.n_experts / o.n_groups;
    const torch::Tensor grouped = choice.view({n, o.n_groups, per_group});
    const torch::Tensor group_scores = std::get<0>(grouped.topk(2, -1)).sum(-1);        // [N, G]
    const torch::Tensor kept = std::get<1>(group_scores.topk(o.topk_groups, -1));       // [N, topk_groups]
    const torch::Tensor mask = torch::ones({n, o.n_groups}, choice.options().dtype(torch::kBool)).scatter(1, kept, false);
    choice = grouped.masked_fill(mask.unsqueeze(-1), -std::numeric_limits<float>::infinity()).view({n, o.n_experts});
  }
  Routing r;
  r.experts = std::get<1>(choice.topk(o.top_k, -1, /*largest=*/true, /*sorted=*/true));
  torch::Tensor weights = scores.gather(1, r.experts);
  // GPT-OSS: the softmax over the k selected logits (their gradient reaches only those logits).
  if (after_topk) weights = weights.softmax(-1);
  if (o.normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  if (o.scale != 1.0) weights = weights * o.scale;
  r.weights = weights;
  // Counts where the routing lives, without a host read (bincount on CUDA reads the maximum back
  // to size its output): the sorted choices' boundaries at 0..E, differenced.
  const torch::Tensor sorted = std::get<0>(r.experts.reshape(-1).sort());
  const torch::Tensor bounds = torch::searchsorted(sorted, torch::arange(o.n_experts + 1, sorted.options()));
  r.counts = bounds.diff();
  return r;
}

Router::Router(int64_t dim, RouterOptions options, const torch::TensorOptions& tensor_options)
    : nn::Module("Router"), options_(options) {
  options_.validate();
  gate_ = register_module("gate", std::make_shared<nn::Linear>(dim, options_.n_experts, tensor_options, options_.gate_bias));
}

Routing Router::forward(const torch::Tensor& x, const torch::Tensor& bias) {
  return route(gate_->forward(x), options_, bias);
}

}  // namespace loom::moe
