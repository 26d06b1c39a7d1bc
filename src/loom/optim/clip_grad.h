// Gradient clipping by global 2-norm, as torch.nn.utils.clip_grad_norm_ (error_if_nonfinite=False,
// foreach=True): per-tensor norms with one at::_foreach_norm per dtype, combined into one norm,
// and every gradient scaled by min(1, max_norm / (norm + 1e-6)). A non-finite norm is not an
// error: the gradients are still scaled (to NaN or 0), exactly as PyTorch does, and the caller sees
// the non-finite norm it returns.
//
// For sharded gradients (FSDP, TP) each rank holds part of every gradient; pass a hook that
// all-reduces (sums) the partial sum of squares across the ranks sharing the gradients.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <functional>

namespace loom::optim {

// Receives this rank's sum of squared gradient elements (0-dim float32, or float64 for float64
// grads) and must replace it in place with the sum over all ranks.
using SquaredNormReduceHook = std::function<void(at::Tensor& sum_of_squares)>;

// Global 2-norm of `grads` (undefined entries are skipped) as a 0-dim tensor. The hook, when set,
// is called exactly once even if this rank has no gradients, so collectives stay matched.
at::Tensor total_grad_norm(at::TensorList grads, const SquaredNormReduceHook& reduce = nullptr);

// Scales `grads` in place by min(1, max_norm / (total_norm + 1e-6)).
void clip_grads_with_norm_(at::TensorList grads, double max_norm, const at::Tensor& total_norm);

// total_grad_norm + clip_grads_with_norm_; returns the norm before clipping. max_norm must be > 0.
at::Tensor clip_grad_norm_(at::TensorList grads, double max_norm,
                           const SquaredNormReduceHook& reduce = nullptr);

}  // namespace loom::optim
