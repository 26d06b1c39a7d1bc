// Float8 linear layers: the GEMMs of y = x W^T and of its backward run on float8 operands with
// dynamic scaling (torchao's Float8Linear recipes "rowwise" and "tensorwise"; docs/float8.md).
//
// Every GEMM of a linear layer is written here as A B^T with A [M, K] and B [N, K], both
// contracted over their last dim K, so each operand is quantized along the dim the GEMM sums over:
//
//   forward        y      = x  W^T     A = x      [tokens, in]   B = W   [out, in]
//   grad_input     dx     = dy W       A = dy     [tokens, out]  B = W^T [in, out]
//   grad_weight    dW     = dy^T x     A = dy^T   [out, tokens]  B = x^T [in, tokens]
//
// Recipes (torchao's Float8LinearRecipeName definitions):
//   rowwise     x, W and dy all float8_e4m3fn; one scale per row of each operand as laid out
//               above (amax over the contracted dim: per token for x in forward, per output
//               feature for W in forward, per input feature for W in grad_input, ...); every scale
//               rounded down to a power of 2, so scaling and unscaling are exact and
//               amax * scale <= 448 still holds.
//   tensorwise  x and W float8_e4m3fn, dy float8_e5m2 (gradients need range more than
//               precision); one scale per tensor, not rounded.
// A scale is fmax / max(amax, 1e-12) (fmax = 448 for e4m3, 57344 for e5m2), computed in float64
// and stored as float32; quantizing is clamp(t * scale, -fmax, fmax) cast to the float8 dtype, so
// values never overflow (saturation), and a zero row gets a finite scale and stays zero.
//
// Under tensor parallelism a linear's local weight is a shard of the whole one (colwise: rows, the
// out features; rowwise: columns, the in features), and so are its input (rowwise) or its output
// gradient (colwise) along those features. The scaled operands follow those placements (torchao's
// Float8 with DTensor, as TorchTitan composes Float8 and TP): an amax taken over a sharded dim is
// all-reduced (max) over the group first, so every rank quantizes its piece with the whole
// tensor's scale and the partial products the TP collectives sum are the single device's pieces.
// Row-wise scales need this only where the GEMM contracts a sharded dim (the forward of a rowwise
// linear, the input gradient of a colwise one); tensor-wise scales wherever an operand is sharded.
//
// On CUDA each GEMM is at::_scaled_mm (float8 operands, float32 inverse scales, bfloat16 output for
// rowwise, float32 for tensorwise; every dim a multiple of 16). On the CPU it is emulated exactly:
// each operand is dequantized (float32 value / scale) and the product taken in float32. Both
// return the input's dtype (under autocast: the autocast dtype), gradients the dtypes of x and W.
// The autograd function saves x and W in their own precision and quantizes again in backward
// along the backward GEMMs' contracted dims (as torchao does), so the memory kept is a plain
// linear's.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>

#include "loom/core/options.h"
#include "loom/distributed/comm.h"

namespace loom::float8 {

enum class Recipe { kRowwise, kTensorwise };

// float8.recipe: "rowwise" | "tensorwise", torchao's names (core/options.h's enum protocol).
const options::EnumNames<Recipe>& option_names(Recipe);

// The float8 dtype finite maximum: 448 (e4m3fn), 57344 (e5m2).
double float8_max(c10::ScalarType dtype);

// An operand quantized for A B^T: `data` [rows, K] in a float8 dtype; `scale` float32, [rows, 1]
// (rowwise) or a 0-dim tensor (tensorwise). The value it stands for is data / scale.
struct Float8Operand {
  torch::Tensor data;
  torch::Tensor scale;
  torch::Tensor inverse_scale;       // 1 / scale, as the GEMM takes it; undefined: computed there
  torch::Tensor dequantize() const;  // float32, data / scale
};

// Quantizes a 2-D tensor for a GEMM contracting its last dim: rowwise (one scale per row, rounded
// down to a power of 2) or tensorwise (one scale). Any floating dtype in, float8 `dtype` out, data
// row-major. On CUDA (fp32/bf16/fp16 operands that are row-major or the transposed view of a
// row-major tensor, as every operand of float8_linear is) Loom's kernels (cuda/quantize.h) do it
// in two passes, transposing on the way; elsewhere the ATen composition. Both give equal bits.
// `amax_group`: the tensor is this rank's piece of one sharded over that group along the dims the
// amax covers; the amax is all-reduced (max) over it (null: the tensor is whole).
Float8Operand quantize(const torch::Tensor& t, c10::ScalarType dtype, Recipe recipe,
                       const std::shared_ptr<distributed::Comm>& amax_group = nullptr);

// The same quantization as ATen operations (fp32 copy, abs, amax, the scale's arithmetic, multiply,
// clamp, cast): the CPU's path, and the reference Loom's CUDA kernels are tested against.
Float8Operand quantize_composed(const torch::Tensor& t, c10::ScalarType dtype, Recipe recipe,
                                const std::shared_ptr<distributed::Comm>& amax_group = nullptr);

// The groups that shard a linear's features (tensor parallelism); null: not sharded.
struct Float8Sharding {
  std::shared_ptr<distributed::Comm> in_features;   // a rowwise-parallel weight: Shard(1)
  std::shared_ptr<distributed::Comm> out_features;  // a colwise-parallel weight: Shard(0)
  bool any() const { return in_features != nullptr || out_features != nullptr; }
};

// A [M, K] times B [N, K]^T -> [M, N] in `out_dtype`: at::_scaled_mm on CUDA, float32 emulation on
// the CPU (dequantize both, float32 matmul).
torch::Tensor scaled_mm_nt(const Float8Operand& a, const Float8Operand& b, c10::ScalarType out_dtype);

// y = x W^T with the recipe's float8 GEMMs forward and backward (a custom autograd function).
// x [..., in], W [out, in]: this rank's pieces when `sharding` names the groups that split them.
// The dims must be multiples of 16 on CUDA (checked by convert_to_float8).
torch::Tensor float8_linear(const torch::Tensor& x, const torch::Tensor& weight, Recipe recipe,
                            const Float8Sharding& sharding = {});

}  // namespace loom::float8
