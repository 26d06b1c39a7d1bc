#include "loom/optim/muon.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "loom/core/error.h"

namespace loom::optim {

const options::EnumNames<MuonLRAdjust>& option_names(MuonLRAdjust) {
  static const options::EnumNames<MuonLRAdjust> names = {{"match_rms_adamw", MuonLRAdjust::kMatchRmsAdamW},
                                                         {"original", MuonLRAdjust::kOriginal}};
  return names;
}

bool is_muon_parameter(std::string_view name, c10::IntArrayRef full_shape) {
  if (full_shape.size() != 2) return false;
  size_t begin = 0;
  while (begin <= name.size()) {
    size_t end = name.find('.', begin);
    if (end == std::string_view::npos) end = name.size();
    const std::string_view component = name.substr(begin, end - begin);
    if (component == "tok_embeddings" || component == "output") return false;
    // A routed-experts stack is a list of per-expert tensors, not one matrix: its 3-D weights fail
    // the shape test above, and its 2-D stacked biases ([experts, width], GPT-OSS's b1/b2/b3) are
    // vectors side by side, which expert parallelism splits by row.
    if (component == "experts") return false;
    begin = end + 1;
  }
  return true;
}

at::Tensor newton_schulz(const at::Tensor& x, int64_t steps, double eps) {
  LOOM_REQUIRE(x.dim() == 2, "Newton-Schulz orthogonalises matrices, got shape ", x.sizes());
  LOOM_REQUIRE(steps >= 0, "Newton-Schulz needs steps >= 0, got ", steps);
  at::Tensor X = x.to(at::kFloat);
  // X X^T is the smaller Gram matrix when rows <= cols; the polar factor of X^T is that of X
  // transposed, so a tall matrix is iterated transposed.
  const bool transposed = X.size(0) > X.size(1);
  if (transposed) X = X.t();
  // Singular values into [0, 1]: the quintic's basin.
  X = X / (at::linalg_vector_norm(X) + eps);
  for (int64_t i = 0; i < steps; ++i) {
    const at::Tensor A = at::matmul(X, X.t());
    const at::Tensor B = at::addmm(A, A, A, kNewtonSchulzB, kNewtonSchulzC);  // b A + c A^2
    X = at::addmm(X, B, X, kNewtonSchulzA, 1.0);                              // a X + B X
  }
  if (transposed) X = X.t();
  return X.contiguous();
}

double muon_lr_scale(int64_t rows, int64_t cols, MuonLRAdjust adjust) {
  if (adjust == MuonLRAdjust::kMatchRmsAdamW) {
    return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
  }
  return std::sqrt(std::max(1.0, static_cast<double>(rows) / static_cast<double>(cols)));
}

void check_muon_options(const MuonOptions& o) {
  LOOM_REQUIRE_USAGE(o.momentum >= 0.0 && o.momentum < 1.0, "Muon momentum must be in [0, 1), got ",
                     o.momentum);
  LOOM_REQUIRE_USAGE(o.ns_steps >= 1, "Muon needs at least 1 Newton-Schulz step, got ", o.ns_steps);
  LOOM_REQUIRE_USAGE(o.ns_eps > 0.0, "Muon's Newton-Schulz eps must be > 0, got ", o.ns_eps);
}

void muon_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& momentum_buffer,
                 double lr, double weight_decay, const MuonOptions& options) {
  LOOM_REQUIRE(param.dim() == 2, "Muon updates matrices, got a parameter of shape ", param.sizes());
  LOOM_REQUIRE(grad.sizes() == param.sizes() && momentum_buffer.sizes() == param.sizes(),
               "Muon: parameter ", param.sizes(), ", gradient ", grad.sizes(), " and momentum ",
               momentum_buffer.sizes(), " must have one shape");
  at::NoGradGuard no_grad;
  at::Tensor buf = momentum_buffer;
  buf.mul_(options.momentum).add_(grad);
  const at::Tensor direction = options.nesterov ? grad.add(buf, options.momentum) : buf;
  const at::Tensor update = newton_schulz(direction, options.ns_steps, options.ns_eps);
  const double scale = muon_lr_scale(param.size(0), param.size(1), options.adjust_lr);
  at::Tensor p = param;
  if (weight_decay != 0.0) p.mul_(1.0 - lr * weight_decay);
  p.add_(update.to(p.scalar_type()), -lr * scale);
}

std::string muon_momentum_key(const std::string& param_name) {
  return param_name + ".momentum_buffer";
}

Muon::Muon(std::vector<ParamGroup> groups, AdamWOptions adamw_options, MuonOptions muon_options)
    : adamw_options_(adamw_options), muon_options_(muon_options) {
  check_muon_options(muon_options_);
  std::vector<ParamGroup> adamw_groups;
  std::unordered_set<std::string> names;
  for (const ParamGroup& group : groups) {
    LOOM_REQUIRE(group.param_names.size() == group.params.size(), "parameter group '", group.name,
                 "' has ", group.param_names.size(), " names for ", group.params.size(),
                 " parameters");
    ParamGroup rest{group.name, {}, {}, group.weight_decay};
    for (const auto i : c10::irange(group.params.size())) {
      const std::string& name = group.param_names[i];
      const at::Tensor& param = group.params[i];
      LOOM_REQUIRE(param.defined() && at::isFloatingType(param.scalar_type()), "parameter '", name,
                   "' is undefined or not floating-point; Muon updates floating-point parameters");
      if (!is_muon_parameter(name, param.sizes())) {
        rest.param_names.push_back(name);
        rest.params.push_back(param);
        continue;
      }
      LOOM_REQUIRE(names.insert(name).second, "parameter name '", name,
                   "' appears more than once in the optimizer's parameter groups");
      slots_.push_back({name, param, at::zeros_like(param, at::MemoryFormat::Contiguous),
                        at::zeros({}, param.options().dtype(at::kFloat)), group.weight_decay});
    }
    if (!rest.params.empty()) adamw_groups.push_back(std::move(rest));
  }
  // AdamW checks its own parameters (duplicates, hyper-parameters) and keeps their state.
  adamw_ = std::make_unique<AdamW>(std::move(adamw_groups), adamw_options_);
}

void Muon::set_lr(double lr) {
  adamw_options_.lr = lr;
  adamw_->set_lr(lr);
}

void Muon::step() {
  adamw_->step();
  for (Slot& s : slots_) {
    const at::Tensor& grad = s.param.grad();
    if (!grad.defined()) continue;
    s.step.add_(1.0);
    muon_update(s.param, grad, s.momentum_buffer, adamw_options_.lr, s.weight_decay, muon_options_);
  }
}

void Muon::zero_grad(bool set_to_none) {
  adamw_->zero_grad(set_to_none);
  for (Slot& s : slots_) zero_gradient(s.param, set_to_none);
}

TensorDict Muon::state_dict() const {
  TensorDict out = adamw_->state_dict();
  for (const Slot& s : slots_) {
    out.emplace(muon_momentum_key(s.name), s.momentum_buffer);
    out.emplace(s.name + ".step", s.step);
  }
  return out;
}

void Muon::load_state_dict(const TensorDict& state) {
  load_state_in_place(state_dict(), state, "Muon");
}

std::vector<std::string> Muon::muon_parameter_names() const {
  std::vector<std::string> out;
  for (const Slot& s : slots_) out.push_back(s.name);
  return out;
}

}  // namespace loom::optim
