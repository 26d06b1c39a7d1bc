#include "loom/optim/optimizer.h"

#include <ATen/ATen.h>

#include "loom/core/error.h"

namespace loom::optim {

bool is_weight_decayed(std::string_view name, c10::IntArrayRef full_shape) {
  const bool is_bias = name == "bias" || (name.size() >= 5 && name.substr(name.size() - 5) == ".bias");
  return full_shape.size() >= 2 && !is_bias;
}

std::vector<ParamGroup> weight_decay_param_groups(const NamedTensors& named_params,
                                                  double weight_decay) {
  ParamGroup decay{"decay", {}, {}, weight_decay};
  ParamGroup no_decay{"no_decay", {}, {}, 0.0};
  for (const auto& [name, param] : named_params) {
    LOOM_REQUIRE(param.defined(), "parameter '", name, "' is undefined; materialize the model ",
                 "before building its optimizer");
    ParamGroup& group = is_weight_decayed(name, param.sizes()) ? decay : no_decay;
    group.param_names.push_back(name);
    group.params.push_back(param);
  }
  std::vector<ParamGroup> groups;
  if (!decay.params.empty()) groups.push_back(std::move(decay));
  if (!no_decay.params.empty()) groups.push_back(std::move(no_decay));
  return groups;
}

ParamGroup single_param_group(const NamedTensors& named_params, double weight_decay,
                              std::string name) {
  ParamGroup group{std::move(name), {}, {}, weight_decay};
  for (const auto& [param_name, param] : named_params) {
    group.param_names.push_back(param_name);
    group.params.push_back(param);
  }
  return group;
}

void load_state_in_place(const TensorDict& expected, const TensorDict& state, const char* who) {
  // Validate everything first so a bad checkpoint leaves the optimizer untouched.
  for (const auto& [key, tensor] : state) {
    LOOM_REQUIRE(expected.count(key), who, " checkpoint has unexpected entry '", key,
                 "'; it was saved for a different optimizer, model or parameter set");
  }
  for (const auto& [key, dst] : expected) {
    auto it = state.find(key);
    LOOM_REQUIRE(it != state.end(), who, " checkpoint is missing entry '", key,
                 "'; it was saved for a different optimizer, model or parameter set");
    LOOM_REQUIRE(it->second.defined() && it->second.sizes() == dst.sizes() &&
                     it->second.scalar_type() == dst.scalar_type(),
                 who, " checkpoint entry '", key, "' is ",
                 it->second.defined() ? c10::str(it->second.scalar_type(), it->second.sizes())
                                      : std::string("<undefined>"),
                 " but this rank's state needs ", dst.scalar_type(), dst.sizes(),
                 "; fix: reshard the checkpoint to this layout");
  }
  at::NoGradGuard no_grad;
  for (const auto& [key, dst] : expected) {
    at::Tensor target = dst;  // shares storage with the state
    target.copy_(state.at(key));
  }
}

void zero_gradient(at::Tensor& param, bool set_to_none) {
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) return;
  if (set_to_none) {
    grad.reset();
  } else {
    grad.detach_();
    grad.zero_();
  }
}

StepGuard clip_and_skip_guard(const at::Tensor& grad_norm, const at::Tensor& loss, double max_norm) {
  LOOM_REQUIRE(max_norm >= 0.0, "max_norm for gradient clipping must be >= 0 (0: no clipping), got ", max_norm);
  LOOM_REQUIRE(grad_norm.numel() == 1 && loss.numel() == 1, "clip_and_skip_guard takes a scalar norm and loss");
  at::NoGradGuard no_grad;
  const at::Tensor norm = grad_norm.detach().reshape({}).to(at::kFloat);
  // The same coefficient as clip_grads_with_norm_: 1 (so grad / 1 is exact) unless clipping; 1
  // always when max_norm is 0 (no clipping).
  const at::Tensor coef = max_norm > 0.0 ? at::clamp_max(max_norm / (norm + 1e-6), 1.0) : at::ones_like(norm);
  StepGuard guard;
  guard.grad_scale = at::reciprocal(coef);
  guard.found_inf = at::logical_not(at::logical_and(at::isfinite(norm),
                                                    at::isfinite(loss.detach().reshape({}).to(norm.device()))))
                        .to(at::kFloat);
  return guard;
}

void Optimizer::step_with_guard(const StepGuard& /*guard*/) {
  fail("this optimizer has no device-side step guard (applies_step_guard() is false): clip the "
       "gradients and check them on the host, then call step()");
}

}  // namespace loom::optim
