#include "loom/moe/moe.h"

#include "loom/core/error.h"

namespace loom::moe {

MoE::MoE(int64_t dim, MoEOptions options, const torch::TensorOptions& tensor_options)
    : nn::Module("MoE"), options_(std::move(options)) {
  LOOM_REQUIRE_USAGE(options_.hidden_dim > 0, "MoE: the experts' hidden width must be > 0, got ", options_.hidden_dim);
  LOOM_REQUIRE_USAGE(options_.load_balance_coeff >= 0, "MoE: load_balance_coeff must be >= 0, got ",
                     options_.load_balance_coeff);
  router_ = register_module("router", std::make_shared<Router>(dim, options_.router, tensor_options));
  experts_ = register_module("experts", std::make_shared<GroupedExperts>(options_.router.n_experts, dim,
                                                                         options_.hidden_dim, tensor_options,
                                                                         options_.experts));
  if (options_.shared_hidden_dim > 0) {
    shared_experts_ = register_module("shared_experts",
                                      std::make_shared<nn::FeedForward>(dim, options_.shared_hidden_dim, tensor_options));
  }
  // Routing state stays float32 whatever the parameters' dtype (counts must be exact, the bias
  // moves in steps of the coefficient).
  const torch::TensorOptions state = tensor_options.dtype(torch::kFloat);
  if (options_.load_balance_coeff > 0) {
    expert_bias_ = register_buffer("expert_bias", torch::zeros({options_.router.n_experts}, state));
  }
  tokens_per_expert_ =
      register_buffer("tokens_per_expert", torch::zeros({options_.router.n_experts}, state), /*persistent=*/false);
}

torch::Tensor MoE::forward(const torch::Tensor& x) {
  return call_with_hooks(x, [this](const torch::Tensor& in) {
    const int64_t dim = in.size(-1);
    const torch::Tensor tokens = in.reshape({-1, dim});
    const int64_t n = tokens.size(0), k = options_.router.top_k;
    const Routing routing = router_->forward(tokens, expert_bias());
    // Training forwards only: validation and generation run without gradients and must not move
    // the balance. (Under activation checkpointing the first forward runs with gradients off inside
    // the checkpoint function: the recompute counts the layer's tokens, once.)
    if (torch::GradMode::is_enabled()) {
      torch::NoGradGuard no_grad;
      tokens_per_expert_->tensor.add_(routing.counts.to(tokens_per_expert_->tensor.device(), torch::kFloat));
    }
    // (token, choice) pairs in expert order; a stable sort keeps each expert's tokens in token order.
    const torch::Tensor flat = routing.experts.reshape(-1);
    const torch::Tensor order = at::argsort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const torch::Tensor rows = tokens.index_select(0, order.div(k, "floor"));
    torch::Tensor out = expert_compute_ ? expert_compute_(*experts_, rows, routing.counts)
                                        : experts_->forward(rows, routing.counts);
    // Weighted in float32, back to (token, choice) order by a gather, summed over the choices.
    const torch::Tensor weights = routing.weights.reshape(-1).index_select(0, order).unsqueeze(1);
    out = out.to(torch::kFloat) * weights;
    const torch::Tensor inverse = at::argsort(order, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    torch::Tensor combined = out.index_select(0, inverse).view({n, k, dim}).sum(1).to(in.scalar_type());
    if (shared_experts_) combined = combined + shared_experts_->forward(tokens);
    return combined.view(in.sizes());
  });
}

void MoE::reset_state() {
  torch::NoGradGuard no_grad;
  if (expert_bias_ != nullptr) expert_bias_->tensor.zero_();
  tokens_per_expert_->tensor.zero_();
}

torch::Tensor expert_bias_update(const torch::Tensor& counts, double coeff) {
  const torch::Tensor n = counts.to(torch::kFloat);
  torch::Tensor delta = coeff * torch::sign(n.mean() - n);
  return delta - delta.mean();
}

void MoE::balance_experts(const torch::Tensor& counts) {
  if (expert_bias_ == nullptr) return;
  torch::NoGradGuard no_grad;
  expert_bias_->tensor.add_(expert_bias_update(counts, options_.load_balance_coeff).to(expert_bias_->tensor.device()));
  tokens_per_expert_->tensor.zero_();
}

void MoE::reset_load_counts() {
  torch::NoGradGuard no_grad;
  if (tokens_per_expert_ != nullptr) tokens_per_expert_->tensor.zero_();
}

}  // namespace loom::moe
