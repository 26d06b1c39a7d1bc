// AdamW with PyTorch's semantics (torch.optim.AdamW: bias-corrected moments, decoupled weight decay
// applied as p *= 1 - lr * weight_decay before the Adam update, amsgrad = maximize = false).
//
// The update runs as one multi-tensor kernel per parameter group: at::_fused_adamw_ (default; a
// vectorised single pass over param/grad/exp_avg/exp_avg_sq, ~4x faster than the foreach path on
// CPU) or the at::_foreach_* sequence PyTorch's foreach=True implementation uses. Parameters may be
// views into a flat buffer; adamw_step_flat() updates a whole flat shard in one kernel call.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loom/core/options.h"
#include "loom/optim/optimizer.h"

namespace loom::optim {

enum class AdamWImplementation { kFused, kForeach };

// optimizer.implementation: "fused" | "foreach" (core/options.h's enum protocol).
const options::EnumNames<AdamWImplementation>& option_names(AdamWImplementation);

struct AdamWOptions {
  double lr = 8e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  AdamWImplementation implementation = AdamWImplementation::kFused;
};

// Whether the fused implementation updates float32 CUDA tensors with Loom's own kernel
// (optim/cuda/adamw_kernel.h; CUDA builds only) instead of at::_fused_adamw_. On by default; the
// Trainer sets it from training.cuda_kernels ("adamw"). Process-wide, like the nn kernels' switch.
void set_cuda_adamw_kernel(bool enabled);
bool cuda_adamw_kernel_enabled();
// Whether this build has the kernel at all (a CUDA build of libtorch).
bool cuda_adamw_kernel_built();

// Throws unless lr, eps >= 0 and both betas lie in [0, 1); `optimizer` names it in the message
// (AdamW and AdamW8bit share these options).
void check_adamw_options(const AdamWOptions& o, const char* optimizer);

// Per-parameter AdamW state, as in torch.optim.AdamW: `step` is a 0-dim float32 tensor.
struct AdamWParamState {
  at::Tensor step;
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;

  // Zero moments shaped like `param` (same dtype and device), step 0.
  static AdamWParamState zeros_like(const at::Tensor& param);
};

class AdamW : public Optimizer {
 public:
  // State is allocated eagerly (zeros), so state_dict() is complete before the first step and
  // load_state_dict() can restore into it. Throws loom::Error on duplicate names or tensors,
  // non-floating-point or undefined parameters, or a bad hyper-parameter.
  AdamW(std::vector<ParamGroup> groups, AdamWOptions options);

  // Updates every parameter whose .grad() is defined (others keep their step count).
  void step() override;
  // The fused kernel applies the guard itself (the foreach implementation reads found_inf once).
  bool applies_step_guard() const override { return true; }
  void step_with_guard(const StepGuard& guard) override;
  // Updates with caller-supplied gradients: grads[g][i] belongs to param_groups()[g].params[i];
  // an undefined tensor skips that parameter. Used when gradients live outside .grad() (e.g. in
  // a flat reduce-scatter buffer).
  void step(const std::vector<std::vector<at::Tensor>>& grads, const StepGuard* guard = nullptr);

  void zero_grad(bool set_to_none = true) override;
  void set_lr(double lr) override { options_.lr = lr; }
  double lr() const override { return options_.lr; }

  // Keys "<param>.step", "<param>.exp_avg", "<param>.exp_avg_sq" for every parameter.
  TensorDict state_dict() const override;
  void load_state_dict(const TensorDict& state) override;

  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  const AdamWOptions& options() const { return options_; }
  const AdamWParamState& state(const std::string& param_name) const;

 private:
  std::vector<ParamGroup> groups_;
  std::vector<std::vector<AdamWParamState>> state_;  // parallel to groups_[g].params
  std::unordered_map<std::string, std::pair<size_t, size_t>> index_;  // name -> (group, slot)
  AdamWOptions options_;
};

// Flat-buffer AdamW state: one tensor per moment covering a whole contiguous shard, one step count.
struct FlatAdamWState {
  at::Tensor step;
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;

  static FlatAdamWState zeros_like(const at::Tensor& flat_param);
};

// Sorted, non-overlapping [begin, end) element ranges of a flat parameter.
using ElementRanges = std::vector<std::pair<int64_t, int64_t>>;

// One AdamW step over a flat contiguous parameter (e.g. an FSDP shard) with its flat gradient and
// state: increments state.step once, then updates everything in one fused kernel call (two when
// `no_decay_ranges` is non-empty: the decayed and the exempt ranges, each as a list of views).
// Elements in `no_decay_ranges` (norm scales, biases) get weight decay 0. Bitwise identical to
// stepping the same elements as separate parameters with AdamW.
// With a guard, gradients are divided by guard->grad_scale and a step where guard->found_inf is 1
// changes nothing (the count included).
void adamw_step_flat(const at::Tensor& param, const at::Tensor& grad, FlatAdamWState& state,
                     const AdamWOptions& options, double weight_decay,
                     const ElementRanges& no_decay_ranges = {}, const StepGuard* guard = nullptr);

}  // namespace loom::optim
