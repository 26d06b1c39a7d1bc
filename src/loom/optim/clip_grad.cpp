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

at::Tensor total_grad_norm(at::TensorList grads, const SquaredNormReduceHook& reduce) {
  at::NoGradGuard no_grad;
  const auto buckets = by_dtype(grads);
  // Norms are computed in float32 (float64 if any gradient is float64). For float32 gradients
  // this is exactly PyTorch's computation; bf16/fp16 gradients get a float32 norm where PyTorch
  // would round each per-tensor norm to the gradient dtype.
  at::ScalarType norm_dtype = at::kFloat;
  for (const auto& [dtype, list] : buckets) norm_dtype = at::promoteTypes(norm_dtype, dtype);
  std::vector<at::Tensor> norms;
  for (const auto& [dtype, list] : buckets) {
    const std::optional<at::ScalarType> accumulate =
        dtype == norm_dtype ? std::nullopt : std::optional<at::ScalarType>(norm_dtype);
    for (at::Tensor& n : at::_foreach_norm(list, 2, accumulate)) norms.push_back(std::move(n));
  }
  at::Tensor total = norms.empty() ? at::zeros({}, at::TensorOptions().dtype(norm_dtype))
                                   : at::linalg_vector_norm(at::stack(norms), 2);
  if (reduce) {
    at::Tensor sum_of_squares = total * total;
    reduce(sum_of_squares);
    LOOM_REQUIRE(sum_of_squares.defined() && sum_of_squares.numel() == 1,
                 "the gradient-norm reduce hook must leave a scalar tensor in place");
    total = sum_of_squares.reshape({}).sqrt();
  }
  return total;
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
