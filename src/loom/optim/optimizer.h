// The optimizer interface shared by every Loom optimizer, and parameter groups.
//
// Optimizers take explicit parameter groups (each with its own weight decay) and keep their state
// in plain tensors keyed by parameter name, so checkpoints can save, reshard and load it like model
// weights. Parameters may be views into a larger flat buffer (FSDP shards): nothing here assumes
// they own their storage.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::optim {

// Flat name -> tensor map used for optimizer and scheduler state (the checkpointer's unit).
using TensorDict = std::map<std::string, at::Tensor>;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct ParamGroup {
  std::string name;                      // e.g. "decay", "no_decay"; used in error messages
  std::vector<std::string> param_names;  // fully qualified, unique across all groups
  std::vector<at::Tensor> params;        // same order as param_names
  double weight_decay = 0.0;
};

// Whether a parameter gets weight decay: 1-D tensors (norm scales) and every bias do not; matrices,
// including the token embedding and output projection, do (TorchTitan decays embeddings too).
// `full_shape` is the parameter's unsharded shape, so FSDP can apply the rule to flat shards.
bool is_weight_decayed(std::string_view name, c10::IntArrayRef full_shape);

// Splits named parameters into a "decay" group (weight_decay) and a "no_decay" group (0) by
// is_weight_decayed, keeping the input order inside each group. Empty groups are left out.
std::vector<ParamGroup> weight_decay_param_groups(const NamedTensors& named_params,
                                                  double weight_decay);

// A single group with one weight decay for every parameter (e.g. tests, or weight_decay = 0).
ParamGroup single_param_group(const NamedTensors& named_params, double weight_decay,
                              std::string name = "all");

// Validates `state` against `expected` (every key present with its shape and dtype, nothing
// unexpected), then copies it in place. `who` names the optimizer in the errors.
void load_state_in_place(const TensorDict& expected, const TensorDict& state, const char* who);

// torch.optim's zero_grad for one parameter: drop its gradient (set_to_none) or zero it in place
// (detached from any graph first). A parameter without a gradient is left alone.
void zero_gradient(at::Tensor& param, bool set_to_none);

// A step decided on the device (torch.amp.GradScaler's contract with the fused optimizers): the
// gradients are divided by `grad_scale` inside the update kernel, and the update (step counts
// included) is skipped where `found_inf` is 1. Both are 0-dim float32 tensors on the parameters'
// device, so a step needs no read-back to the host: gradient clipping and the non-finite guard fold
// into the optimizer's own pass over the gradients.
struct StepGuard {
  at::Tensor grad_scale;
  at::Tensor found_inf;
};

// The guard for clipping to `max_norm` and skipping a non-finite step, from the global gradient
// norm and the global loss (both 0-dim, any floating dtype): grad_scale = 1 / min(1, max_norm /
// (norm + 1e-6)), the reciprocal of clip_grads_with_norm_'s coefficient (1 when max_norm is 0: no
// clipping); found_inf = 1 when the norm or the loss is NaN/inf. No host sync.
StepGuard clip_and_skip_guard(const at::Tensor& grad_norm, const at::Tensor& loss, double max_norm);

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of every parameter whose .grad() is defined.
  virtual void step() = 0;
  // Whether step_with_guard applies the guard on the device (without a host sync).
  virtual bool applies_step_guard() const { return false; }
  // step() with gradients divided by guard.grad_scale, skipped entirely where guard.found_inf is 1.
  // The gradients' values afterwards are unspecified (divided or not, by implementation).
  // Optimizers without a device-side guard (applies_step_guard() false) throw: their callers clip
  // and check on the host instead.
  virtual void step_with_guard(const StepGuard& guard);
  virtual void zero_grad(bool set_to_none = true) = 0;
  virtual void set_lr(double lr) = 0;
  virtual double lr() const = 0;
  // The state tensors themselves (not copies): clone them to keep a snapshot.
  virtual TensorDict state_dict() const = 0;
  // Copies `state` into the existing state tensors in place (so views into flat buffers stay
  // views); throws loom::Error on a missing, unexpected or mis-shaped entry.
  virtual void load_state_dict(const TensorDict& state) = 0;
};

}  // namespace loom::optim
