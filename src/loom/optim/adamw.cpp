#include "loom/optim/adamw.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <cmath>
#include <atomic>
#include <map>
#include <optional>
#include <unordered_set>

#include "loom/core/error.h"

#ifdef LOOM_WITH_CUDA_OPTIM_KERNELS
#include "loom/optim/cuda/adamw_kernel.h"
#endif

namespace loom::optim {
namespace {

std::atomic<bool> g_cuda_adamw_kernel{true};

// Parallel tensor lists for one multi-tensor update; `steps` already hold the incremented count.
struct UpdateLists {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;

  void add(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
           const at::Tensor& exp_avg_sq, const at::Tensor& step) {
    params.push_back(param);
    grads.push_back(grad);
    exp_avgs.push_back(exp_avg);
    exp_avg_sqs.push_back(exp_avg_sq);
    steps.push_back(step);
  }
  bool empty() const { return params.empty(); }
};

// The same at::_foreach_* sequence as torch.optim.AdamW(foreach=True) without capturable.
void foreach_update(const UpdateLists& l, const AdamWOptions& o, double weight_decay) {
  if (weight_decay != 0.0) at::_foreach_mul_(l.params, 1.0 - o.lr * weight_decay);
  at::_foreach_lerp_(l.exp_avgs, l.grads, 1.0 - o.beta1);
  at::_foreach_mul_(l.exp_avg_sqs, o.beta2);
  at::_foreach_addcmul_(l.exp_avg_sqs, l.grads, l.grads, 1.0 - o.beta2);
  std::vector<at::Scalar> neg_step_size, bias_correction2_sqrt;
  neg_step_size.reserve(l.steps.size());
  bias_correction2_sqrt.reserve(l.steps.size());
  for (const at::Tensor& step : l.steps) {
    const double t = step.item<double>();
    neg_step_size.emplace_back(-(o.lr / (1.0 - std::pow(o.beta1, t))));
    bias_correction2_sqrt.emplace_back(std::sqrt(1.0 - std::pow(o.beta2, t)));
  }
  std::vector<at::Tensor> denom = at::_foreach_sqrt(l.exp_avg_sqs);
  at::_foreach_div_(denom, bias_correction2_sqrt);
  at::_foreach_add_(denom, o.eps);
  at::_foreach_addcdiv_(l.params, l.exp_avgs, denom, neg_step_size);
}

// Runs one update over lists whose steps were already incremented. Tensors are bucketed by dtype
// (as PyTorch does); the fused kernel indexes raw memory, so it gets only contiguous parameters
// (with contiguous gradients) and anything else takes the foreach path.
//
// With a guard, the fused kernels divide the gradients by guard->grad_scale and return early where
// guard->found_inf is 1 (no read-back). The foreach path has no such argument: it reads found_inf on
// the host (one sync) and divides the gradients in place, so it skips the same steps. (The gradients
// after a guarded step are unspecified: at::_fused_adamw_ and foreach leave them divided, Loom's
// CUDA kernel leaves them as they were, saving a write.)
void apply_update(const UpdateLists& lists, const AdamWOptions& o, double weight_decay,
                  const StepGuard* guard = nullptr) {
  if (lists.empty()) return;
  std::map<at::ScalarType, UpdateLists> fused, foreach;
  for (const auto i : c10::irange(lists.params.size())) {
    const at::Tensor& p = lists.params[i];
    const bool use_fused = o.implementation == AdamWImplementation::kFused && p.is_contiguous() &&
                           lists.exp_avgs[i].is_contiguous() &&
                           lists.exp_avg_sqs[i].is_contiguous();
    if (use_fused) {
      fused[p.scalar_type()].add(p, lists.grads[i].contiguous(), lists.exp_avgs[i],
                                 lists.exp_avg_sqs[i], lists.steps[i]);
    } else {
      foreach[p.scalar_type()].add(p, lists.grads[i], lists.exp_avgs[i], lists.exp_avg_sqs[i],
                                   lists.steps[i]);
    }
  }
  std::optional<at::Tensor> grad_scale, found_inf;
  if (guard) {
    grad_scale = guard->grad_scale;
    found_inf = guard->found_inf;
  }
  for (auto& [dtype, l] : fused) {
#ifdef LOOM_WITH_CUDA_OPTIM_KERNELS
    // Loom's kernel for float32 master weights on a GPU: one launch per tensor (the step counts
    // are per tensor), each at close to the memory bandwidth.
    if (dtype == at::kFloat && l.params.front().is_cuda() && cuda_adamw_kernel_enabled()) {
      const at::Tensor none;
      for (const auto i : c10::irange(l.params.size())) {
        cuda::adamw_update_(l.params[i], l.grads[i], l.exp_avgs[i], l.exp_avg_sqs[i], l.steps[i], o.lr, o.beta1,
                            o.beta2, weight_decay, o.eps, guard ? guard->grad_scale : none,
                            guard ? guard->found_inf : none);
      }
      continue;
    }
#endif
    at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, /*max_exp_avg_sqs=*/{},
                      l.steps, o.lr, o.beta1, o.beta2, weight_decay, o.eps, /*amsgrad=*/false,
                      /*maximize=*/false, grad_scale, found_inf);
  }
  for (auto& [dtype, l] : foreach) {
    if (guard) {
      if (guard->found_inf.item<float>() == 1.0f) continue;
      at::_foreach_div_(l.grads, guard->grad_scale);
    }
    foreach_update(l, o, weight_decay);
  }
}

void check_guard(const StepGuard& guard) {
  LOOM_REQUIRE(guard.grad_scale.defined() && guard.found_inf.defined() && guard.grad_scale.numel() == 1 &&
                   guard.found_inf.numel() == 1 && guard.grad_scale.scalar_type() == at::kFloat &&
                   guard.found_inf.scalar_type() == at::kFloat,
               "a StepGuard holds two 0-dim float32 tensors (grad_scale, found_inf); make it with "
               "optim::clip_and_skip_guard");
}

void check_grad(const std::string& name, const at::Tensor& param, const at::Tensor& grad) {
  LOOM_REQUIRE(grad.sizes() == param.sizes(), "gradient of '", name, "' has shape ", grad.sizes(),
               " but the parameter has shape ", param.sizes());
  LOOM_REQUIRE(grad.scalar_type() == param.scalar_type(), "gradient of '", name, "' is ",
               grad.scalar_type(), " but the parameter is ", param.scalar_type(),
               "; keep gradients in the parameter dtype (master weights) for the optimizer");
  LOOM_REQUIRE(grad.device() == param.device(), "gradient of '", name, "' is on ", grad.device(),
               " but the parameter is on ", param.device());
}

}  // namespace

void set_cuda_adamw_kernel(bool enabled) { g_cuda_adamw_kernel.store(enabled); }
bool cuda_adamw_kernel_enabled() { return g_cuda_adamw_kernel.load(); }
bool cuda_adamw_kernel_built() {
#ifdef LOOM_WITH_CUDA_OPTIM_KERNELS
  return true;
#else
  return false;
#endif
}

void check_adamw_options(const AdamWOptions& o, const char* optimizer) {
  LOOM_REQUIRE(o.lr >= 0.0, optimizer, " lr must be >= 0, got ", o.lr);
  LOOM_REQUIRE(o.beta1 >= 0.0 && o.beta1 < 1.0, optimizer, " beta1 must be in [0, 1), got ", o.beta1);
  LOOM_REQUIRE(o.beta2 >= 0.0 && o.beta2 < 1.0, optimizer, " beta2 must be in [0, 1), got ", o.beta2);
  LOOM_REQUIRE(o.eps >= 0.0, optimizer, " eps must be >= 0, got ", o.eps);
}

const options::EnumNames<AdamWImplementation>& option_names(AdamWImplementation) {
  static const options::EnumNames<AdamWImplementation> names = {{"fused", AdamWImplementation::kFused},
                                                                {"foreach", AdamWImplementation::kForeach}};
  return names;
}

AdamWParamState AdamWParamState::zeros_like(const at::Tensor& param) {
  return {at::zeros({}, param.options().dtype(at::kFloat)), at::zeros_like(param),
          at::zeros_like(param)};
}

FlatAdamWState FlatAdamWState::zeros_like(const at::Tensor& flat_param) {
  return {at::zeros({}, flat_param.options().dtype(at::kFloat)),
          at::zeros_like(flat_param, at::MemoryFormat::Contiguous),
          at::zeros_like(flat_param, at::MemoryFormat::Contiguous)};
}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions options)
    : groups_(std::move(groups)), options_(options) {
  check_adamw_options(options_, "AdamW");
  std::unordered_set<const c10::TensorImpl*> seen;
  state_.reserve(groups_.size());
  for (const auto g : c10::irange(groups_.size())) {
    const ParamGroup& group = groups_[g];
    LOOM_REQUIRE(group.param_names.size() == group.params.size(), "parameter group '",
                 group.name, "' has ", group.param_names.size(), " names for ",
                 group.params.size(), " parameters");
    LOOM_REQUIRE(group.weight_decay >= 0.0, "weight decay of parameter group '", group.name,
                 "' must be >= 0, got ", group.weight_decay);
    auto& group_state = state_.emplace_back();
    group_state.reserve(group.params.size());
    for (const auto i : c10::irange(group.params.size())) {
      const std::string& name = group.param_names[i];
      const at::Tensor& param = group.params[i];
      LOOM_REQUIRE(param.defined(), "parameter '", name, "' is undefined");
      LOOM_REQUIRE(at::isFloatingType(param.scalar_type()), "parameter '", name, "' has dtype ",
                   param.scalar_type(), "; AdamW updates floating-point parameters only");
      LOOM_REQUIRE(index_.emplace(name, std::make_pair(g, i)).second, "parameter name '", name,
                   "' appears more than once in the optimizer's parameter groups");
      LOOM_REQUIRE(seen.insert(param.unsafeGetTensorImpl()).second, "parameter '", name,
                   "' is the same tensor as another parameter in the optimizer");
      group_state.push_back(AdamWParamState::zeros_like(param));
    }
  }
}

void AdamW::step() {
  std::vector<std::vector<at::Tensor>> grads(groups_.size());
  for (const auto g : c10::irange(groups_.size())) {
    grads[g].reserve(groups_[g].params.size());
    for (const at::Tensor& p : groups_[g].params) grads[g].push_back(p.grad());
  }
  step(grads);
}

void AdamW::step_with_guard(const StepGuard& guard) {
  std::vector<std::vector<at::Tensor>> grads(groups_.size());
  for (const auto g : c10::irange(groups_.size())) {
    grads[g].reserve(groups_[g].params.size());
    for (const at::Tensor& p : groups_[g].params) grads[g].push_back(p.grad());
  }
  step(grads, &guard);
}

void AdamW::step(const std::vector<std::vector<at::Tensor>>& grads, const StepGuard* guard) {
  if (guard) check_guard(*guard);
  LOOM_REQUIRE(grads.size() == groups_.size(), "AdamW::step got gradients for ", grads.size(),
               " parameter groups but the optimizer has ", groups_.size());
  at::NoGradGuard no_grad;
  for (const auto g : c10::irange(groups_.size())) {
    const ParamGroup& group = groups_[g];
    LOOM_REQUIRE(grads[g].size() == group.params.size(), "AdamW::step got ", grads[g].size(),
                 " gradients for parameter group '", group.name, "' of ", group.params.size(),
                 " parameters");
    UpdateLists lists;
    for (const auto i : c10::irange(group.params.size())) {
      const at::Tensor& grad = grads[g][i];
      if (!grad.defined()) continue;
      check_grad(group.param_names[i], group.params[i], grad);
      const AdamWParamState& s = state_[g][i];
      lists.add(group.params[i], grad, s.exp_avg, s.exp_avg_sq, s.step);
    }
    if (lists.empty()) continue;
    at::_foreach_add_(lists.steps, 1.0);
    apply_update(lists, options_, group.weight_decay, guard);
    // A skipped step leaves the counts as they were (torch.optim's fused path does the same).
    if (guard) at::_foreach_sub_(lists.steps, std::vector<at::Tensor>(lists.steps.size(), guard->found_inf));
  }
}

void AdamW::zero_grad(bool set_to_none) {
  for (ParamGroup& group : groups_) {
    for (at::Tensor& p : group.params) zero_gradient(p, set_to_none);
  }
}

TensorDict AdamW::state_dict() const {
  TensorDict out;
  for (const auto g : c10::irange(groups_.size())) {
    for (const auto i : c10::irange(groups_[g].params.size())) {
      const std::string& name = groups_[g].param_names[i];
      const AdamWParamState& s = state_[g][i];
      out.emplace(name + ".step", s.step);
      out.emplace(name + ".exp_avg", s.exp_avg);
      out.emplace(name + ".exp_avg_sq", s.exp_avg_sq);
    }
  }
  return out;
}

void AdamW::load_state_dict(const TensorDict& state) { load_state_in_place(state_dict(), state, "AdamW"); }

const AdamWParamState& AdamW::state(const std::string& param_name) const {
  auto it = index_.find(param_name);
  LOOM_REQUIRE(it != index_.end(), "the optimizer has no parameter named '", param_name, "'");
  return state_[it->second.first][it->second.second];
}

void adamw_step_flat(const at::Tensor& param, const at::Tensor& grad, FlatAdamWState& state,
                     const AdamWOptions& options, double weight_decay,
                     const ElementRanges& no_decay_ranges, const StepGuard* guard) {
  check_adamw_options(options, "AdamW");
  if (guard) check_guard(*guard);
  LOOM_REQUIRE(param.dim() == 1 && param.is_contiguous(),
               "adamw_step_flat needs a 1-D contiguous parameter, got shape ", param.sizes());
  check_grad("flat parameter", param, grad);
  LOOM_REQUIRE(state.exp_avg.sizes() == param.sizes() && state.exp_avg_sq.sizes() == param.sizes(),
               "flat AdamW state has ", state.exp_avg.numel(), " elements for a parameter of ",
               param.numel(), "; create it with FlatAdamWState::zeros_like");
  LOOM_REQUIRE(weight_decay >= 0.0, "weight decay must be >= 0, got ", weight_decay);
  at::NoGradGuard no_grad;
  state.step.add_(1.0);
  if (no_decay_ranges.empty()) {
    UpdateLists all;
    all.add(param, grad, state.exp_avg, state.exp_avg_sq, state.step);
    apply_update(all, options, weight_decay, guard);
    if (guard) state.step.sub_(guard->found_inf);
    return;
  }
  UpdateLists decayed, exempt;
  auto add_range = [&](UpdateLists& l, int64_t begin, int64_t end) {
    if (end <= begin) return;
    l.add(param.slice(0, begin, end), grad.slice(0, begin, end),
          state.exp_avg.slice(0, begin, end), state.exp_avg_sq.slice(0, begin, end), state.step);
  };
  int64_t cursor = 0;
  for (const auto& [begin, end] : no_decay_ranges) {
    LOOM_REQUIRE(begin >= cursor && begin <= end && end <= param.numel(),
                 "no-decay range [", begin, ", ", end, ") is out of order, overlapping or outside ",
                 "the flat parameter of ", param.numel(), " elements");
    add_range(decayed, cursor, begin);
    add_range(exempt, begin, end);
    cursor = end;
  }
  add_range(decayed, cursor, param.numel());
  apply_update(decayed, options, weight_decay, guard);
  apply_update(exempt, options, 0.0, guard);
  if (guard) state.step.sub_(guard->found_inf);
}

}  // namespace loom::optim
