// Loom's SwiGLU, RoPE and RMSNorm CUDA kernels (nn/cuda/kernels.h), forward and backward, against
// the ATen compositions they replace, run with autograd in fp32 on the same (dtype-rounded) inputs.
// Tolerances: fp32 kernels rtol = atol = 1e-5 (only the fast-math exp/rsqrt and summation order
// differ); bf16 outputs atol = rtol = 2e-2 compared in fp32 (a bf16 rounding is <= 2^-9 relative);
// RMSNorm's d weight (a sum over rows) by relative norm, 1e-5 fp32 / 1e-2 bf16. Shapes: a real
// one, odd ones (D = 100, 3 rows, totals that are not a multiple of the vector width) and
// misaligned or strided views that force the kernels' scalar paths.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#ifdef LOOM_WITH_CUDA_KERNELS
#include <ATen/autocast_mode.h>

#include "loom/nn/cuda/kernels.h"
#include "loom/nn/fused.h"
#include "loom/nn/rope.h"
#endif

namespace elementwise_kernels_test {

#ifdef LOOM_WITH_CUDA_KERNELS
struct Tol {
  double rtol, atol;
};

Tol tol_for(c10::ScalarType dtype) {
  return dtype == torch::kFloat32 ? Tol{1e-5, 1e-5} : Tol{2e-2, 2e-2};
}

void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, Tol tol,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  ASSERT_TRUE(actual.is_cuda()) << what;
  const torch::Tensor a = actual.to(torch::kFloat32).cpu();
  const torch::Tensor e = expected.to(torch::kFloat32).cpu();
  ASSERT_FALSE(a.isnan().any().item<bool>()) << what << ": NaN in the kernel's output";
  EXPECT_TRUE(torch::allclose(a, e, tol.rtol, tol.atol))
      << what << ": max |diff| " << (a - e).abs().max().item<double>() << " (max |expected| "
      << e.abs().max().item<double>() << ")";
}

void expect_rel_norm(const torch::Tensor& actual, const torch::Tensor& expected, double bound,
                     const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const torch::Tensor a = actual.to(torch::kFloat64).cpu();
  const torch::Tensor e = expected.to(torch::kFloat64).cpu();
  const double rel = (a - e).norm().item<double>() / (e.norm().item<double>() + 1e-30);
  EXPECT_LT(rel, bound) << what << ": relative norm error " << rel;
}

torch::Tensor randn_cuda(at::IntArrayRef shape, c10::ScalarType dtype, double scale = 1.0) {
  return (torch::randn(shape, torch::TensorOptions(torch::kCUDA)) * scale).to(dtype);
}

// ---- SwiGLU ----

void check_swiglu(const torch::Tensor& gate, const torch::Tensor& up, const std::string& what) {
  const c10::ScalarType dtype = gate.scalar_type();
  const torch::Tensor grad = randn_cuda(gate.sizes(), dtype);
  const torch::Tensor g = gate.detach().to(torch::kFloat32).requires_grad_(true);
  const torch::Tensor u = up.detach().to(torch::kFloat32).requires_grad_(true);
  const torch::Tensor ref = at::silu(g) * u;
  ref.backward(grad.to(torch::kFloat32));

  const torch::Tensor out = loom::nn::cuda::swiglu_forward(gate, up);
  EXPECT_EQ(out.scalar_type(), dtype) << what;
  EXPECT_TRUE(out.is_contiguous()) << what;
  expect_close(out, ref, tol_for(dtype), what + " forward");
  const auto [dgate, dup] = loom::nn::cuda::swiglu_backward(grad, gate, up);
  EXPECT_EQ(dgate.scalar_type(), dtype) << what;
  EXPECT_EQ(dup.scalar_type(), dtype) << what;
  expect_close(dgate, g.grad(), tol_for(dtype), what + " d gate");
  expect_close(dup, u.grad(), tol_for(dtype), what + " d up");
}

// ---- RoPE ----

// The generic composition (nn/fused.cpp's rotary_composite), here in fp32.
torch::Tensor rotary_reference(const torch::Tensor& x, const torch::Tensor& cache) {
  const int64_t seq = x.size(1);
  const int64_t half = x.size(3) / 2;
  const torch::Tensor cos = cache.select(0, 0).narrow(0, 0, seq).unsqueeze(1);
  const torch::Tensor sin = cache.select(0, 1).narrow(0, 0, seq).unsqueeze(1);
  const torch::Tensor swapped = torch::cat({x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + swapped * sin;
}

// cache_len > T so that the kernel's indexing of the sin half (offset cache_len * D) is tested.
torch::Tensor make_cache(int64_t head_dim, int64_t cache_len) {
  return loom::nn::rope_cache(loom::nn::rope_inverse_frequencies(head_dim, 500000.0, std::nullopt),
                              cache_len)
      .to(torch::kCUDA);
}

void check_rope(const torch::Tensor& x, const torch::Tensor& cache, const std::string& what) {
  const c10::ScalarType dtype = x.scalar_type();
  const torch::Tensor grad = randn_cuda(x.sizes(), dtype);
  const torch::Tensor x32 = x.detach().to(torch::kFloat32).requires_grad_(true);
  const torch::Tensor ref = rotary_reference(x32, cache);
  ref.backward(grad.to(torch::kFloat32));

  const torch::Tensor out = loom::nn::cuda::rope_forward(x, cache, /*inverse=*/false);
  EXPECT_EQ(out.scalar_type(), dtype) << what;
  EXPECT_TRUE(out.is_contiguous()) << what;
  expect_close(out, ref, tol_for(dtype), what + " forward");
  // The inverse rotation is the backward of the forward one.
  const torch::Tensor back = loom::nn::cuda::rope_forward(grad, cache, /*inverse=*/true);
  expect_close(back, x32.grad(), tol_for(dtype), what + " inverse vs autograd backward");
  // And it undoes the forward (fp32: the bf16 round trip rounds twice).
  if (dtype == torch::kFloat32) {
    const torch::Tensor round_trip = loom::nn::cuda::rope_forward(out, cache, /*inverse=*/true);
    expect_close(round_trip, x, tol_for(dtype), what + " inverse(forward(x)) == x");
  }
}

// ---- RMSNorm ----

void check_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, c10::ScalarType out_dtype,
                    const std::string& what) {
  constexpr double kEps = 1e-5;
  const int64_t dim = x.size(-1);
  const torch::Tensor grad = randn_cuda(x.sizes(), out_dtype);
  const torch::Tensor x32 = x.detach().to(torch::kFloat32).requires_grad_(true);
  const torch::Tensor w32 = weight.detach().to(torch::kFloat32).requires_grad_(true);
  const torch::Tensor ref = at::rms_norm(x32, {dim}, w32, kEps);
  ref.backward(grad.to(torch::kFloat32));
  const torch::Tensor ref_rstd =
      (x32.detach().pow(2).mean(-1) + kEps).rsqrt().reshape({x.numel() / dim});

  const auto [y, rstd] = loom::nn::cuda::rms_norm_forward(x, weight, kEps, out_dtype);
  EXPECT_EQ(y.scalar_type(), out_dtype) << what;
  EXPECT_EQ(rstd.scalar_type(), torch::kFloat32) << what;
  expect_close(y, ref, tol_for(out_dtype), what + " forward");
  expect_close(rstd, ref_rstd, tol_for(torch::kFloat32), what + " rstd");

  const auto [dx, dw] = loom::nn::cuda::rms_norm_backward(grad, x, weight, rstd);
  EXPECT_EQ(dx.scalar_type(), x.scalar_type()) << what;
  EXPECT_EQ(dw.scalar_type(), weight.scalar_type()) << what;
  expect_close(dx, x32.grad(), tol_for(x.scalar_type()), what + " d x");
  const bool all_fp32 = x.scalar_type() == torch::kFloat32 &&
                        weight.scalar_type() == torch::kFloat32 && out_dtype == torch::kFloat32;
  expect_rel_norm(dw, w32.grad(), all_fp32 ? 1e-5 : 1e-2, what + " d weight");
  if (weight.scalar_type() == torch::kFloat32) {
    // fp32 d weight from the same (rounded) inputs: per-element too, scaled to the sums' size.
    const double scale = w32.grad().abs().max().item<double>();
    expect_close(dw, w32.grad(), Tol{1e-4, 1e-5 * scale}, what + " d weight elementwise");
  }
}

// ---- Residual add + RMSNorm ----

// sum = residual + delta, y = rms_norm(sum); the reference takes both outputs' gradients
// (grad_sum from the sum's other uses) through autograd in fp32.
void check_add_rms_norm(const torch::Tensor& residual, const torch::Tensor& delta,
                        const torch::Tensor& weight, c10::ScalarType out_dtype, bool with_grad_sum,
                        const std::string& what) {
  constexpr double kEps = 1e-5;
  const int64_t dim = residual.size(-1);
  const torch::Tensor grad_y = randn_cuda(residual.sizes(), out_dtype);
  const torch::Tensor grad_sum =
      with_grad_sum ? randn_cuda(residual.sizes(), residual.scalar_type()) : torch::Tensor();
  const torch::Tensor r32 = residual.detach().to(torch::kFloat32).requires_grad_(true);
  const torch::Tensor d32 = delta.detach().to(torch::kFloat32).requires_grad_(true);
  const torch::Tensor w32 = weight.detach().to(torch::kFloat32).requires_grad_(true);
  const torch::Tensor s32 = r32 + d32;
  const torch::Tensor ref = at::rms_norm(s32, {dim}, w32, kEps);
  torch::Tensor objective = (ref * grad_y.to(torch::kFloat32)).sum();
  if (with_grad_sum) objective = objective + (s32 * grad_sum.to(torch::kFloat32)).sum();
  objective.backward();

  const auto [sum, y, rstd] = loom::nn::cuda::add_rms_norm_forward(residual, delta, weight, kEps, out_dtype);
  EXPECT_EQ(sum.scalar_type(), residual.scalar_type()) << what;
  EXPECT_EQ(y.scalar_type(), out_dtype) << what;
  expect_close(sum, s32, tol_for(residual.scalar_type()), what + " sum");
  expect_close(y, ref, tol_for(out_dtype == torch::kFloat32 ? residual.scalar_type() : out_dtype),
               what + " forward");

  const auto [d_residual, d_delta, dw] = loom::nn::cuda::add_rms_norm_backward(
      grad_y, grad_sum, sum, weight, rstd, delta.scalar_type());
  EXPECT_EQ(d_residual.scalar_type(), residual.scalar_type()) << what;
  EXPECT_EQ(d_delta.scalar_type(), delta.scalar_type()) << what;
  EXPECT_EQ(dw.scalar_type(), weight.scalar_type()) << what;
  expect_close(d_residual, r32.grad(), tol_for(residual.scalar_type()), what + " d residual");
  expect_close(d_delta, d32.grad(), tol_for(delta.scalar_type()), what + " d delta");
  const bool all_fp32 = residual.scalar_type() == torch::kFloat32 &&
                        delta.scalar_type() == torch::kFloat32 &&
                        weight.scalar_type() == torch::kFloat32 && out_dtype == torch::kFloat32;
  expect_rel_norm(dw, w32.grad(), all_fp32 ? 1e-5 : 1e-2, what + " d weight");
}
#endif

TEST(CudaElementwiseKernels, SwiGLUMatchesComposition) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  torch::manual_seed(0);
  for (const c10::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
    const std::string name = std::string(c10::toString(dtype));
    for (const std::vector<int64_t>& shape :
         std::vector<std::vector<int64_t>>{{1000, 2048}, {3, 100}, {3, 101}, {7}, {1, 64}}) {
      const torch::Tensor gate = randn_cuda(shape, dtype, 3.0);
      const torch::Tensor up = randn_cuda(shape, dtype);
      check_swiglu(gate, up, name + " " + c10::str(at::IntArrayRef(shape)));
    }
    // Views one element off a 16-byte boundary take the scalar path.
    const int64_t n = 3 * 1000 + 5;
    const torch::Tensor base_g = randn_cuda({n + 1}, dtype, 3.0);
    const torch::Tensor base_u = randn_cuda({n + 1}, dtype);
    check_swiglu(base_g.narrow(0, 1, n), base_u.narrow(0, 1, n), name + " misaligned");
    // Non-contiguous inputs (the two halves of a fused gate/up projection).
    const torch::Tensor fused = randn_cuda({64, 2 * 96}, dtype);
    check_swiglu(fused.narrow(1, 0, 96), fused.narrow(1, 96, 96), name + " strided halves");
  }
#endif
}

TEST(CudaElementwiseKernels, SwiGLURejectsBadInputs) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  const torch::Tensor g = randn_cuda({4, 8}, torch::kFloat32);
  EXPECT_THROW(loom::nn::cuda::swiglu_forward(g, randn_cuda({4, 9}, torch::kFloat32)), c10::Error);
  EXPECT_THROW(loom::nn::cuda::swiglu_forward(g, g.to(torch::kBFloat16)), c10::Error);
  EXPECT_THROW(loom::nn::cuda::swiglu_forward(g.cpu(), g.cpu()), c10::Error);
#endif
}

TEST(CudaElementwiseKernels, RoPEMatchesComposition) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  torch::manual_seed(1);
  for (const c10::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
    const std::string name = std::string(c10::toString(dtype));
    // {B, T, H, D}: the real head shape, D = 100 (half not a multiple of the vector width: scalar
    // path), 3 rows, and D = 2.
    for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
             {2, 128, 8, 64}, {1, 3, 1, 100}, {3, 1, 1, 64}, {2, 5, 3, 2}}) {
      const torch::Tensor cache = make_cache(shape[3], shape[1] + 7);
      check_rope(randn_cuda(shape, dtype), cache, name + " " + c10::str(at::IntArrayRef(shape)));
    }
    const torch::Tensor cache = make_cache(64, 256);
    // Heads of a fused qkv projection: [B, T, 3H, D] narrowed to the k heads (strided rows).
    const torch::Tensor qkv = randn_cuda({2, 33, 3 * 4, 64}, dtype);
    check_rope(qkv.narrow(2, 4, 4), cache, name + " qkv slice");
    // [B, H, T, D] transposed to [B, T, H, D].
    check_rope(randn_cuda({2, 4, 17, 64}, dtype).transpose(1, 2), cache, name + " transposed");
    // Rows one element off the vector boundary: scalar path with vector-friendly D.
    const torch::Tensor flat = randn_cuda({2 * 9 * 3 * 64 + 1}, dtype);
    check_rope(flat.narrow(0, 1, 2 * 9 * 3 * 64).view({2, 9, 3, 64}), cache, name + " misaligned");
  }
#endif
}

TEST(CudaElementwiseKernels, RoPEInverseIsTheRotationByMinusTheAngle) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  // The forward rotates each pair (x1, x2) by +angle: (x1 cos - x2 sin, x2 cos + x1 sin). The
  // inverse rotates by -angle: (x1 cos + x2 sin, x2 cos - x1 sin) = x * cos + swap_halves(x) *
  // [sin, -sin], written out from cos and sin (not the cache's folded signs) so that the sign
  // convention itself is under test.
  torch::manual_seed(2);
  const int64_t seq = 16, dim = 64, half = dim / 2;
  const torch::Tensor inv_freq = loom::nn::rope_inverse_frequencies(dim, 500000.0, std::nullopt);
  const torch::Tensor angles =
      torch::outer(torch::arange(seq, torch::kFloat32), inv_freq).to(torch::kCUDA);
  const torch::Tensor cos = torch::cat({angles.cos(), angles.cos()}, -1).unsqueeze(1);
  const torch::Tensor sin = torch::cat({angles.sin(), -angles.sin()}, -1).unsqueeze(1);
  const torch::Tensor x = randn_cuda({2, seq, 4, dim}, torch::kFloat32);
  const torch::Tensor swapped = torch::cat({x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  const torch::Tensor expected = x * cos + swapped * sin;
  const torch::Tensor cache = loom::nn::rope_cache(inv_freq, seq).to(torch::kCUDA);
  expect_close(loom::nn::cuda::rope_forward(x, cache, /*inverse=*/true), expected,
               tol_for(torch::kFloat32), "inverse rotation");
#endif
}

TEST(CudaElementwiseKernels, RoPERejectsBadInputs) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  const torch::Tensor x = randn_cuda({1, 8, 2, 64}, torch::kFloat32);
  EXPECT_THROW(loom::nn::cuda::rope_forward(x, make_cache(64, 4), false), c10::Error);  // T > len
  EXPECT_THROW(loom::nn::cuda::rope_forward(x, make_cache(32, 8), false), c10::Error);  // D
  EXPECT_THROW(loom::nn::cuda::rope_forward(x, make_cache(64, 8).to(torch::kBFloat16), false),
               c10::Error);
  EXPECT_THROW(loom::nn::cuda::rope_forward(x.reshape({8, 2, 64}), make_cache(64, 8), false),
               c10::Error);
#endif
}

TEST(CudaElementwiseKernels, RMSNormMatchesComposition) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  torch::manual_seed(3);
  struct Case {
    c10::ScalarType x, weight, out;
  };
  // fp32 throughout; the Llama layout (fp32 x and weight, bf16 output for the GEMM); bf16 x;
  // all bf16.
  const std::vector<Case> cases = {{torch::kFloat32, torch::kFloat32, torch::kFloat32},
                                   {torch::kFloat32, torch::kFloat32, torch::kBFloat16},
                                   {torch::kBFloat16, torch::kFloat32, torch::kBFloat16},
                                   {torch::kBFloat16, torch::kBFloat16, torch::kBFloat16}};
  for (const Case& c : cases) {
    const std::string name = std::string(c10::toString(c.x)) + "/" + c10::toString(c.weight) +
                             "->" + c10::toString(c.out);
    // [rows, D]: a real one, D = 100 (scalar path), 3 rows, D = 64, a 3-d x, D = 2 and one row
    // wider than the shared-memory accumulator (12288 fp32) so d weight accumulates in global.
    for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
             {1000, 2048}, {5, 100}, {3, 2048}, {37, 64}, {2, 3, 100}, {9, 2}, {4, 16384}}) {
      const torch::Tensor x = randn_cuda(shape, c.x, 2.0);
      const torch::Tensor weight =
          (1.0 + 0.1 * torch::randn({shape.back()}, torch::kCUDA)).to(c.weight);
      check_rms_norm(x, weight, c.out, name + " " + c10::str(at::IntArrayRef(shape)));
    }
    // Misaligned x (scalar path with D a multiple of the vector width).
    const torch::Tensor flat = randn_cuda({17 * 256 + 1}, c.x);
    const torch::Tensor weight = (1.0 + 0.1 * torch::randn({256}, torch::kCUDA)).to(c.weight);
    check_rms_norm(flat.narrow(0, 1, 17 * 256).view({17, 256}), weight, c.out,
                   name + " misaligned");
  }
#endif
}

TEST(CudaElementwiseKernels, AddRMSNormMatchesTheAddThenTheNorm) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  torch::manual_seed(5);
  struct Case {
    c10::ScalarType residual, delta, out;
  };
  // The Llama layout under autocast (fp32 residual stream, bf16 block output, bf16 normed output
  // for the GEMM), fp32 throughout, and bf16 throughout.
  const std::vector<Case> cases = {{torch::kFloat32, torch::kBFloat16, torch::kBFloat16},
                                   {torch::kFloat32, torch::kFloat32, torch::kFloat32},
                                   {torch::kBFloat16, torch::kBFloat16, torch::kBFloat16}};
  for (const Case& c : cases) {
    const std::string name = std::string(c10::toString(c.residual)) + "+" +
                             c10::toString(c.delta) + "->" + c10::toString(c.out);
    for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
             {1000, 2048}, {5, 100}, {2, 3, 100}, {9, 2}, {4, 16384}}) {
      const torch::Tensor residual = randn_cuda(shape, c.residual, 2.0);
      const torch::Tensor delta = randn_cuda(shape, c.delta);
      const torch::Tensor weight = (1.0 + 0.1 * torch::randn({shape.back()}, torch::kCUDA));
      for (const bool with_grad_sum : {true, false}) {
        check_add_rms_norm(residual, delta, weight, c.out, with_grad_sum,
                           name + " " + c10::str(at::IntArrayRef(shape)) +
                               (with_grad_sum ? " grad_sum" : " no grad_sum"));
      }
    }
    // A misaligned delta (the scalar path with D a multiple of the vector width).
    const torch::Tensor flat = randn_cuda({17 * 256 + 1}, c.delta);
    const torch::Tensor residual = randn_cuda({17, 256}, c.residual);
    const torch::Tensor weight = 1.0 + 0.1 * torch::randn({256}, torch::kCUDA);
    check_add_rms_norm(residual, flat.narrow(0, 1, 17 * 256).view({17, 256}), weight, c.out, true,
                       name + " misaligned");
  }
  // A narrower residual than delta is refused (the sum is stored in the residual's dtype).
  EXPECT_THROW(loom::nn::cuda::add_rms_norm_forward(randn_cuda({4, 64}, torch::kBFloat16),
                                                    randn_cuda({4, 64}, torch::kFloat32),
                                                    torch::ones({64}, torch::kCUDA), 1e-5,
                                                    torch::kFloat32),
               c10::Error);
#endif
}

// The autograd wiring (nn::fused_add_rms_norm's CUDA Function) under bf16 autocast, as a block
// uses it: the fp32 residual stream plus a bf16 block output, against the unfused composition.
TEST(CudaElementwiseKernels, FusedAddRMSNormGradientsEqualTheComposition) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  torch::manual_seed(6);
  const torch::Tensor residual = randn_cuda({64, 512}, torch::kFloat32, 2.0);
  const torch::Tensor delta = randn_cuda({64, 512}, torch::kBFloat16);
  const torch::Tensor weight = 1.0 + 0.1 * torch::randn({512}, torch::kCUDA);
  const torch::Tensor grad_sum = randn_cuda({64, 512}, torch::kFloat32);
  const torch::Tensor grad_y = randn_cuda({64, 512}, torch::kFloat32);
  std::vector<std::vector<torch::Tensor>> results;
  for (const loom::nn::FusedImpl impl : {loom::nn::FusedImpl::kCuda, loom::nn::FusedImpl::kGeneric}) {
    const torch::Tensor r = residual.clone().requires_grad_(true);
    const torch::Tensor d = delta.clone().requires_grad_(true);
    const torch::Tensor w = weight.clone().requires_grad_(true);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    auto [sum, y] = loom::nn::fused_add_rms_norm(r, d, w, 1e-5, impl);
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    EXPECT_EQ(sum.scalar_type(), torch::kFloat32);
    if (impl == loom::nn::FusedImpl::kCuda) EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    const torch::Tensor objective =
        (sum * grad_sum).sum() + (y.to(torch::kFloat32) * grad_y).sum();
    const auto grads = torch::autograd::grad({objective}, {r, d, w});
    EXPECT_EQ(grads[0].scalar_type(), torch::kFloat32);
    EXPECT_EQ(grads[1].scalar_type(), torch::kBFloat16);
    results.push_back({sum, y, grads[0], grads[1], grads[2]});
  }
  const char* names[] = {"sum", "y", "d residual", "d delta", "d weight"};
  for (size_t i = 0; i < 4; ++i) {
    expect_close(results[0][i], results[1][i], Tol{2e-2, 2e-2}, names[i]);
  }
  expect_rel_norm(results[0][4], results[1][4], 1e-2, names[4]);
#endif
}

TEST(CudaElementwiseKernels, RMSNormRejectsBadInputs) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  const torch::Tensor x = randn_cuda({4, 64}, torch::kFloat32);
  const torch::Tensor w = torch::ones({64}, torch::kCUDA);
  EXPECT_THROW(
      loom::nn::cuda::rms_norm_forward(x, torch::ones({63}, torch::kCUDA), 1e-5, torch::kFloat32),
      c10::Error);
  EXPECT_THROW(loom::nn::cuda::rms_norm_forward(x, w.cpu(), 1e-5, torch::kFloat32), c10::Error);
  const auto [y, rstd] = loom::nn::cuda::rms_norm_forward(x, w, 1e-5, torch::kFloat32);
  EXPECT_THROW(loom::nn::cuda::rms_norm_backward(y, x, w, rstd.narrow(0, 0, 3)), c10::Error);
  EXPECT_THROW(loom::nn::cuda::rms_norm_backward(y.narrow(0, 0, 3), x, w, rstd), c10::Error);
#endif
}

}  // namespace elementwise_kernels_test
