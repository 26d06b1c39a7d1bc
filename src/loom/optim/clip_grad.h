// Gradient clipping by global 2-norm, as torch.nn.utils.clip_grad_norm_ (error_if_nonfinite=False,
// foreach=True): per-tensor norms with one at::_foreach_norm per dtype, combined into one norm,
// and every gradient scaled by min(1, max_norm / (norm + 1e-6)). A non-finite norm is not an
// error: the gradients are still scaled (to NaN or 0), exactly as PyTorch does, and the caller sees
// the non-finite norm it returns.
//
// One difference from PyTorch, on purpose: the squares accumulate in float64. PyTorch's CPU norm
// kernel sums a float32 tensor's squares in float32, which on one 0.5M-element embedding gradient
// is 1e-4 relative off (and differently off for each way the tensor is cut into shards), so a
// single process and a TP or FSDP run of the same model would report norms 1e-4 apart and clip
// differently. In float64 every layout's norm is the exact one to within float32's last bit.
//
// For sharded gradients (FSDP, TP) each rank holds part of every gradient; pass a hook that
// all-reduces (sums) the partial sum of squares across the ranks sharing the gradients.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <functional>

namespace loom::optim {

// Receives this rank's sum of squared gradient elements (0-dim float64) and must replace it in
// place with the sum over all ranks.
using SquaredNormReduceHook = std::function<void(at::Tensor& sum_of_squares)>;

// The sum of the squares of every element of `grads` (undefined entries skipped), accumulated in
// float64: a 0-dim float64 tensor on the gradients' device (`options`' when there are none).
at::Tensor sum_of_squares(at::TensorList grads, const at::TensorOptions& options = {});

// Global 2-norm of `grads` (undefined entries are skipped) as a 0-dim float32 tensor (float64 if
// any gradient is float64). The hook, when set, is called exactly once even if this rank has no
// gradients, so collectives stay matched.
at::Tensor total_grad_norm(at::TensorList grads, const SquaredNormReduceHook& reduce = nullptr);

// Scales `grads` in place by min(1, max_norm / (total_norm + 1e-6)).
void clip_grads_with_norm_(at::TensorList grads, double max_norm, const at::Tensor& total_norm);

// total_grad_norm + clip_grads_with_norm_; returns the norm before clipping. max_norm must be > 0.
at::Tensor clip_grad_norm_(at::TensorList grads, double max_norm,
                           const SquaredNormReduceHook& reduce = nullptr);

}  // namespace loom::optim
