// Loom's own CUDA kernels for the Llama layers (built only when libtorch has CUDA: LOOM_WITH_CUDA).
//
// Why hand-written: C++ has no torch.compile, so the fusions that compile finds for PyTorch users
// (SwiGLU, RMSNorm, RoPE, the classifier's softmax + loss + dlogits) have to be Loom's. Each kernel
// makes one pass over its inputs where the ATen composition makes several, reads bf16/fp16/fp32 and
// does its math in fp32.
//
// These are plain functions of tensors (no autograd): nn/fused.cpp wraps them in autograd Functions
// and chooses them through fused_impl_for (FusedImpl::kCuda). All inputs must be CUDA tensors on one
// device; the functions run on the current CUDA stream and never synchronise with the host.
#pragma once
#include <ATen/Tensor.h>

#include <cstdint>
#include <tuple>

namespace loom::nn::cuda {

// silu(gate) * up, in gate's dtype. gate and up: same shape and dtype (fp32, bf16 or fp16).
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
// (d gate, d up) of silu(gate) * up from the output gradient, in gate's dtype; sigmoid recomputed.
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_out, const at::Tensor& gate,
                                                   const at::Tensor& up);

// Rotate-half RoPE (loom/nn/rope.h convention): x [B, T, H, D] (any strides with a unit last
// stride), cache [2, >=T, D] fp32 contiguous (cos, sign-folded sin). Returns a contiguous tensor in
// x's dtype. inverse = true applies the inverse rotation (the backward of the forward one).
at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cache, bool inverse);

// RMSNorm over the last dimension: y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps).
// x [..., D] contiguous (fp32/bf16/fp16), weight [D] (fp32/bf16/fp16). y is in out_dtype (so a bf16
// GEMM can read it without a cast pass), rstd fp32 [rows].
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight,
                                                    double eps, at::ScalarType out_dtype);
// (d x in x's dtype, d weight in weight's dtype) from d y (any floating dtype, x's shape).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd);

// The residual add in front of a norm, fused with it: sum = residual + delta (stored in the
// residual's dtype, which must be the wider of the two: fp32 residual stream + bf16 block output
// under autocast), y = RMSNorm(sum) in out_dtype, rstd fp32 [rows]. One pass instead of the add's
// and the norm's. residual and delta: same shape, any strides (copied when not contiguous).
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor& residual,
                                                                    const at::Tensor& delta,
                                                                    const at::Tensor& weight,
                                                                    double eps,
                                                                    at::ScalarType out_dtype);
// Its backward: d sum = the norm's backward of grad_y + grad_sum (the gradient reaching the sum
// from its other uses; undefined = none). Returns (d residual in sum's dtype, d delta in
// delta_dtype -- the same values, written by the same pass -- , d weight in weight's dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_backward(
    const at::Tensor& grad_y, const at::Tensor& grad_sum, const at::Tensor& sum,
    const at::Tensor& weight, const at::Tensor& rstd, at::ScalarType delta_dtype);

// One chunk of the fused linear + cross-entropy (llm.c's fused classifier), in place:
// logits [c, V] contiguous (fp32/bf16/fp16) -> scale * (softmax(logits) - onehot(label)) on rows
// whose label is not ignore_index, zeros on ignored rows (only when write_grad; else untouched).
// row_loss [c] fp32 receives logsumexp - logit[label] (0 on ignored rows). scale: 0-dim fp32 device
// tensor (read on the device, so the caller needs no host sync). A label outside [0, V) that is not
// ignore_index sets *bad_label (0-dim int32 device tensor) to 1 and is treated as ignored: no
// out-of-bounds read, no device assert.
void cross_entropy_chunk_(at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index,
                          const at::Tensor& scale, at::Tensor& row_loss, at::Tensor& bad_label,
                          bool write_grad);

}  // namespace loom::nn::cuda

namespace loom::nn::cuda {

// Bytes the caching allocator could hand out on `device` without asking the driver for more than
// it has: the driver's free memory plus what the allocator holds reserved but unused. Sizes the
// cross-entropy chunks; no host-device synchronisation.
int64_t allocatable_bytes(int device_index);

}  // namespace loom::nn::cuda
