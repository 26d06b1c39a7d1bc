// Loom's AdamW update for float32 tensors on a CUDA device (built only in CUDA builds:
// LOOM_WITH_CUDA_OPTIM_KERNELS).
//
// Why hand-written: the update is memory bound (per element it reads parameter, gradient and both
// moments, 16 bytes, and writes parameter and moments, 12), and at::_fused_adamw_ moves those
// bytes at about half of an H200's bandwidth (issue 24's trace: ~20 ms per step for a 1.5B-parameter
// model, 14 % of the step). This kernel does one 16-byte vector load and store per operand and
// thread, its math in fp32, and reads the step count and the StepGuard's scalars on the device.
#pragma once
#include <ATen/Tensor.h>

namespace loom::optim::cuda {

// One AdamW update in place, with torch.optim.AdamW's semantics (decoupled decay p *= 1 - lr * wd,
// bias-corrected moments, amsgrad = maximize = false). param, grad, exp_avg, exp_avg_sq: float32,
// same numel, contiguous, one CUDA device. step: 0-dim float32 on that device, already incremented.
// grad_scale / found_inf (0-dim float32, or undefined): the gradient is divided by grad_scale, and
// nothing is written where found_inf is 1. The gradient itself is never written.
void adamw_update_(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                   const at::Tensor& step, double lr, double beta1, double beta2, double weight_decay,
                   double eps, const at::Tensor& grad_scale, const at::Tensor& found_inf);

}  // namespace loom::optim::cuda
