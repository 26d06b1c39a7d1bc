#include "loom/optim/clip_grad.h"

#include <ATen/ATen.h>

#include <map>
#include <vector>

#include "loom/core/error.h"

namespace loom::optim {
namespace {

// Defined gradients bucketed by dtype: the foreach kernels want homogeneous lists.
std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype(at::TensorList grads) {
  std::map<at::ScalarType, std::vector<at::Tensor>> buckets;
  for (const at::Tensor& g : grads) {
    if (g.defined()) buckets[g.scalar_type()].push_back(g);
  }
  return buckets;
}

}  // namespace

at::Tensor sum_of_squares(at::TensorList grads, const at::TensorOptions& options) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  c10::Device device = options.device();
  for (const auto& [dtype, list] : by_dtype(grads)) {
    device = list.front().device();
    for (at::Tensor& n : at::_foreach_norm(list, 2, at::kDouble)) norms.push_back(std::move(n));
  }
  if (norms.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  return at::stack(norms).square().sum();
}

at::Tensor total_grad_norm(at::TensorList grads, const SquaredNormReduceHook& reduce) {
  at::NoGradGuard no_grad;
  // The norm is float32 (float64 if any gradient is float64), as PyTorch's; its squares are summed
  // in float64 (see the header).
  at::ScalarType norm_dtype = at::kFloat;
  for (const at::Tensor& g : grads) {
    if (g.defined()) norm_dtype = at::promoteTypes(norm_dtype, g.scalar_type());
  }
  at::Tensor squares = sum_of_squares(grads);
  if (reduce) {
    reduce(squares);
    LOOM_REQUIRE(squares.defined() && squares.numel() == 1,
                 "the gradient-norm reduce hook must leave a scalar tensor in place");
  }
  return squares.reshape({}).sqrt().to(norm_dtype);
}

void clip_grads_with_norm_(at::TensorList grads, double max_norm, const at::Tensor& total_norm) {
  LOOM_REQUIRE(max_norm > 0.0, "max_norm for gradient clipping must be > 0, got ", max_norm);
  at::NoGradGuard no_grad;
  const at::Tensor clip_coef = max_norm / (total_norm + 1e-6);
  // Multiplying by the clamped coefficient even when it is 1 avoids a host sync on the norm (as
  // PyTorch does) and lets a NaN/inf norm propagate into the gradients.
  const at::Tensor clip_coef_clamped = at::clamp_max(clip_coef, 1.0);
  for (const auto& [dtype, list] : by_dtype(grads)) {
    at::_foreach_mul_(list, clip_coef_clamped.to(dtype));
  }
}

at::Tensor clip_grad_norm_(at::TensorList grads, double max_norm,
                           const SquaredNormReduceHook& reduce) {
  at::Tensor total = total_grad_norm(grads, reduce);
  clip_grads_with_norm_(grads, max_norm, total);
  return total;
}

}  // namespace loom::optim
