// Loom's float8 quantization kernels (float8/cuda/quantize.h, reached through float8::quantize on
// CUDA) against the ATen composition they replace (float8::quantize_composed), bit for bit: the
// float8 data, the scales and their inverses, for both recipes and both float8 dtypes, on row-major
// operands and on transposed views (the backward's W^T, dy^T, x^T), over real Llama shapes, odd
// ones (no vector path, partial 32 x 32 tiles), zero rows, NaN, and values that saturate.
// Then float8_linear's forward and backward on the GPU (at::_scaled_mm) against the CPU's exact
// emulation of the same recipe on the same inputs: the operands are equal float8 values, so the
// only difference is the GEMM's accumulation order and its bf16 output (relative 2^-8).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>
#include <vector>

#ifdef LOOM_WITH_CUDA_FLOAT8_KERNELS
#include "loom/float8/cuda/quantize.h"
#include "loom/float8/float8.h"
#endif

namespace float8_kernels_test {

#ifdef LOOM_WITH_CUDA_FLOAT8_KERNELS
using loom::float8::Float8Operand;
using loom::float8::Recipe;

void expect_same_bits(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  ASSERT_TRUE(a.is_contiguous()) << what << ": the kernel's data must be row-major";
  const torch::Tensor x = a.contiguous().view(torch::kUInt8).cpu();
  const torch::Tensor y = b.contiguous().view(torch::kUInt8).cpu();
  const int64_t differ = x.ne(y).sum().item<int64_t>();
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << x.numel() << " bytes differ";
}

// Equal bits, except that a NaN equals any NaN (the H200 run: ATen's division and Loom's gave NaN
// scales with different payloads; the float8 data they produce are the same bytes).
void expect_same_float_bits(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.numel(), b.numel()) << what;
  const torch::Tensor fa = a.to(torch::kFloat32).contiguous().cpu().flatten();
  const torch::Tensor fb = b.to(torch::kFloat32).contiguous().cpu().flatten();
  const torch::Tensor both_nan = fa.isnan().logical_and(fb.isnan());
  const torch::Tensor same = fa.view(torch::kInt32).eq(fb.view(torch::kInt32)).logical_or(both_nan);
  EXPECT_TRUE(same.all().item<bool>()) << what << ": scales differ at " << (~same).sum().item<int64_t>()
                                       << " of " << fa.numel() << " places";
}

// Values over many binades (1e-6 .. 1e4), a zero row and, optionally, a NaN.
torch::Tensor operand(int64_t rows, int64_t cols, c10::ScalarType dtype, bool with_nan) {
  torch::manual_seed(rows * 131 + cols);
  torch::Tensor t = torch::randn({rows, cols}) * torch::exp(torch::rand({rows, cols}) * 20 - 12);
  if (rows > 2) t[1].zero_();
  if (with_nan && rows > 3 && cols > 3) t[3][2] = std::numeric_limits<float>::quiet_NaN();
  return t.to(dtype).to(torch::kCUDA);
}

void check(const torch::Tensor& t, c10::ScalarType f8, Recipe recipe, const std::string& what) {
  const Float8Operand k = loom::float8::quantize(t, f8, recipe);
  const Float8Operand r = loom::float8::quantize_composed(t, f8, recipe);
  expect_same_bits(k.data, r.data, what + " data");
  ASSERT_EQ(k.scale.sizes(), r.scale.sizes()) << what;
  expect_same_float_bits(k.scale, r.scale, what + " scale");
  ASSERT_TRUE(k.inverse_scale.defined()) << what;
  expect_same_float_bits(k.inverse_scale, r.scale.reciprocal(), what + " 1 / scale");
}

struct Shape {
  int64_t rows, cols;
};

const std::vector<Shape> kShapes = {{2048, 2048}, {4096, 8192}, {256, 14336}, {37, 50}, {3, 24}, {65, 33}, {1, 16}};
#endif

TEST(CudaFloat8Kernels, QuantizeEqualsTheAtenCompositionBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_FLOAT8_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  for (const c10::ScalarType dtype : {torch::kBFloat16, torch::kFloat32, torch::kFloat16}) {
    for (const Shape s : kShapes) {
      const torch::Tensor t = operand(s.rows, s.cols, dtype, /*with_nan=*/false);
      const std::string name = std::string(c10::toString(dtype)) + " [" + std::to_string(s.rows) + ", " +
                               std::to_string(s.cols) + "]";
      check(t, torch::kFloat8_e4m3fn, Recipe::kRowwise, name + " rowwise");
      check(t.t(), torch::kFloat8_e4m3fn, Recipe::kRowwise, name + "^T rowwise");
      check(t, torch::kFloat8_e4m3fn, Recipe::kTensorwise, name + " tensorwise e4m3");
      check(t.t(), torch::kFloat8_e5m2, Recipe::kTensorwise, name + "^T tensorwise e5m2");
      check(t, torch::kFloat8_e5m2, Recipe::kRowwise, name + " rowwise e5m2");
    }
  }
#endif
}

TEST(CudaFloat8Kernels, NanPropagatesAndSaturationClampsAsAtenDoes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_FLOAT8_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  const torch::Tensor t = operand(64, 96, torch::kBFloat16, /*with_nan=*/true);
  check(t, torch::kFloat8_e4m3fn, Recipe::kRowwise, "NaN rowwise");
  check(t.t(), torch::kFloat8_e4m3fn, Recipe::kRowwise, "NaN^T rowwise");
  check(t, torch::kFloat8_e4m3fn, Recipe::kTensorwise, "NaN tensorwise");
  // Tensor-wise scales are not rounded: values at amax land on fmax exactly, never beyond.
  const Float8Operand q = loom::float8::quantize(operand(128, 64, torch::kFloat32, false), torch::kFloat8_e4m3fn,
                                                 Recipe::kTensorwise);
  EXPECT_LE(q.data.to(torch::kFloat32).abs().max().item<float>(), 448.0f);
  EXPECT_EQ(q.data.to(torch::kFloat32).abs().max().item<float>(), 448.0f);
#endif
}

TEST(CudaFloat8Kernels, Float8LinearOnTheGpuFollowsTheCpuEmulation) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_FLOAT8_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  for (const Recipe recipe : {Recipe::kRowwise, Recipe::kTensorwise}) {
    torch::manual_seed(7);
    // bf16 inputs as a mixed-precision run holds them; the CPU gets the same bf16 values.
    const torch::Tensor x0 = torch::randn({4, 256, 512}).to(torch::kBFloat16);
    const torch::Tensor w0 = (torch::randn({768, 512}) * 0.05).to(torch::kBFloat16);
    const torch::Tensor gy = torch::randn({4, 256, 768}).to(torch::kBFloat16);
    auto run = [&](torch::Device device) {
      torch::Tensor x = x0.to(device).requires_grad_(true);
      torch::Tensor w = w0.to(device).requires_grad_(true);
      torch::Tensor y = loom::float8::float8_linear(x, w, recipe);
      y.backward(gy.to(device));
      return std::vector<torch::Tensor>{y.detach().to(torch::kFloat32).cpu(), x.grad().to(torch::kFloat32).cpu(),
                                        w.grad().to(torch::kFloat32).cpu()};
    };
    const auto gpu = run(torch::kCUDA);
    const auto cpu = run(torch::kCPU);
    const char* names[] = {"y", "dx", "dw"};
    for (int i = 0; i < 3; ++i) {
      // Relative to the tensor's norm: a bf16 output rounding (2^-9) plus accumulation order.
      const double rel = ((gpu[i] - cpu[i]).norm() / cpu[i].norm()).item<double>();
      EXPECT_LT(rel, 1e-2) << (recipe == Recipe::kRowwise ? "rowwise " : "tensorwise ") << names[i]
                           << ": relative error " << rel;
      EXPECT_FALSE(gpu[i].isnan().any().item<bool>()) << names[i];
    }
  }
#endif
}

}  // namespace float8_kernels_test
