// Loom's float8 quantization kernels (built only when libtorch has CUDA: LOOM_WITH_CUDA).
//
// Why hand-written: the ATen composition of one quantization (cast to fp32, abs, amax, the scale's
// arithmetic, multiply, clamp, cast to float8, and a transposing copy for the backward's operands)
// is ten passes and as many launches; on the GPU's Llama 1B run it made Float8 2.4x slower than
// bf16 (the casts took 5x the float8 GEMMs' time). Here a quantization is two passes: the abs-max
// of each row (or column), then one pass that computes each scale from its amax and writes the
// float8 data, transposed where the GEMM needs it. Between the two, a sharded operand's amax is
// all-reduced by the caller (float8.cpp), so the kernels know nothing of ranks.
//
// Values equal the ATen composition bit for bit (tests/cuda/kernels/test_cuda_float8.cpp): the
// amax and product are the same fp32 operations, the scale is fmax / max(amax, 1e-12) in fp64
// rounded to fp32 (and for row-wise scales exp2(floor(log2(scale))) with the same device log2f
// and exp2f; the library is built without fast math), the cast is c10's float8 conversion of the
// clamped value. NaN propagates through the amax and the clamp as it does through ATen's.
#pragma once
#include <ATen/Tensor.h>

#include <tuple>

namespace loom::float8::cuda {

// The abs-max of each row of a 2-D row-major tensor `t` [R, C] (per_column = false: [R]) or of
// each column (per_column = true: [C]), fp32. t: fp32, bf16 or fp16, contiguous, on a CUDA device.
at::Tensor abs_max(const at::Tensor& t, bool per_column);

// Quantizes `t` [R, C] (contiguous) with the scales of `amax`:
//   transpose = false: one scale per row (amax [R]) or one in all (amax [1], per_tensor); data
//                      [R, C];
//   transpose = true:  one scale per column (amax [C]) or one in all; data [C, R], the float8
//                      operand of t^T laid out row-major (what a GEMM contracting over R reads).
// scale = fmax / max(amax, 1e-12) (fp64, rounded to fp32), then rounded down to a power of 2 when
// pow2; data = float8(clamp(t * scale, -fmax, fmax)) in `dtype` (float8_e4m3fn or float8_e5m2).
// Returns (data, scale, 1 / scale), the scales fp32 [n] (n = amax's length).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& t, const at::Tensor& amax,
                                                        bool transpose, bool per_tensor, at::ScalarType dtype,
                                                        double fmax, bool pow2);

}  // namespace loom::float8::cuda
