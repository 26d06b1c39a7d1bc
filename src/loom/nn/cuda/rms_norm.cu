// RMSNorm forward and backward over the last dimension (declared in kernels.h). One block owns a
// row at a time: the sum of squares (forward) or of dy * w * x (backward) is a block reduction, and
// the second pass over the row re-reads it from L1/L2 rather than HBM. All math is fp32; the weight
// is read as fp32 (a [D] cast when it is not, negligible next to the [rows, D] traffic).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "loom/nn/cuda/kernels.h"

namespace loom::nn::cuda {
namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = static_cast<float>(v.v[k]);
}

template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int k = 0; k < N; ++k) v.v[k] = static_cast<T>(in[k]);
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Every thread gets the block's total (each warp re-reduces the per-warp partials, so no second
// broadcast round). blockDim.x must be a multiple of 32. The leading barrier keeps a fast warp
// from overwriting `scratch` while a slow one still reads the previous row's partials.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x >> 5);
  return warp_sum(lane < warps ? scratch[lane] : 0.0f);
}

// Vectors of N elements; the caller picks N = 1 unless dim % N == 0 and every pointer is aligned.
template <typename x_t, typename y_t, int N>
__global__ void rms_norm_forward_kernel(const x_t* __restrict__ x, const float* __restrict__ weight,
                                        y_t* __restrict__ y, float* __restrict__ rstd, int64_t rows,
                                        int64_t dim, float eps) {
  __shared__ float scratch[32];
  const int64_t n_vec = dim / N;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const x_t* xr = x + row * dim;
    float sum_sq = 0.0f;
    for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
      float xs[N];
      load_vec<N>(xr + v * N, xs);
#pragma unroll
      for (int k = 0; k < N; ++k) sum_sq += xs[k] * xs[k];
    }
    sum_sq = block_sum(sum_sq, scratch);
    const float r = rsqrtf(sum_sq / static_cast<float>(dim) + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    y_t* yr = y + row * dim;
    for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
      float xs[N], ws[N], ys[N];
      load_vec<N>(xr + v * N, xs);
      load_vec<N>(weight + v * N, ws);
      // (x * rstd) * w: at::rms_norm's order, so fp32 results agree to the last bits.
#pragma unroll
      for (int k = 0; k < N; ++k) ys[k] = xs[k] * r * ws[k];
      store_vec<N>(yr + v * N, ys);
    }
  }
}

// The residual add fused in front of the norm: s = residual + delta (rounded to the residual's
// dtype, as the unfused add would store it), y = s * rstd(s) * w. Each thread re-reads only the
// elements of `sum` it wrote itself, so the second pass needs no barrier and hits L1/L2.
template <typename x_t, typename d_t, typename y_t, int N>
__global__ void add_rms_norm_forward_kernel(const x_t* __restrict__ residual,
                                            const d_t* __restrict__ delta,
                                            const float* __restrict__ weight, x_t* __restrict__ sum,
                                            y_t* __restrict__ y, float* __restrict__ rstd,
                                            int64_t rows, int64_t dim, float eps) {
  __shared__ float scratch[32];
  const int64_t n_vec = dim / N;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * dim;
    float sum_sq = 0.0f;
    for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
      float rs[N], ds[N], ss[N];
      load_vec<N>(residual + base + v * N, rs);
      load_vec<N>(delta + base + v * N, ds);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        ss[k] = static_cast<float>(static_cast<x_t>(rs[k] + ds[k]));
        sum_sq += ss[k] * ss[k];
      }
      store_vec<N>(sum + base + v * N, ss);
    }
    sum_sq = block_sum(sum_sq, scratch);
    const float r = rsqrtf(sum_sq / static_cast<float>(dim) + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
      float ss[N], ws[N], ys[N];
      load_vec<N>(sum + base + v * N, ss);
      load_vec<N>(weight + v * N, ws);
#pragma unroll
      for (int k = 0; k < N; ++k) ys[k] = ss[k] * r * ws[k];
      store_vec<N>(y + base + v * N, ys);
    }
  }
}

// p: N floats, 16-byte aligned when N % 4 == 0 (shared or global; generic addressing).
template <int N>
__device__ __forceinline__ void accumulate(float* p, const float (&add)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
      float4* q = reinterpret_cast<float4*>(p) + c;
      float4 a = *q;
      a.x += add[4 * c];
      a.y += add[4 * c + 1];
      a.z += add[4 * c + 2];
      a.w += add[4 * c + 3];
      *q = a;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] += add[k];
  }
}

// dx = rstd * w * dy - rstd^3 / dim * x * sum(dy * w * x) per row. d weight = sum over rows of
// dy * x * rstd: each thread owns the same columns in every row, so it accumulates them without
// atomics, in shared memory (acc_in_smem) or, for rows too wide for it, straight in its block's
// row of `partial` [gridDim.x, dim], which the host then sums over blocks.
//
// kResidual (the backward of add_rms_norm_forward): dx also adds grad_sum, the gradient reaching
// the sum from its other uses, and is written a second time in o_t to grad_x2 when that is not
// null (the delta's gradient in the delta's dtype), so the add's backward costs no extra pass.
template <typename gy_t, typename x_t, typename o_t, int N, bool kResidual>
__global__ void rms_norm_backward_kernel(const gy_t* __restrict__ grad_y, const x_t* __restrict__ x,
                                         const float* __restrict__ weight,
                                         const float* __restrict__ rstd, x_t* __restrict__ grad_x,
                                         float* __restrict__ partial, int64_t rows, int64_t dim,
                                         bool acc_in_smem, const x_t* __restrict__ grad_sum,
                                         o_t* __restrict__ grad_x2) {
  extern __shared__ float4 smem_acc[];
  __shared__ float scratch[32];
  const int64_t n_vec = dim / N;
  float* block_partial = partial + static_cast<int64_t>(blockIdx.x) * dim;
  float* acc = acc_in_smem ? reinterpret_cast<float*>(smem_acc) : block_partial;
  for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
#pragma unroll
    for (int k = 0; k < N; ++k) acc[v * N + k] = 0.0f;
  }
  const float inv_dim = 1.0f / static_cast<float>(dim);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const gy_t* gr = grad_y + row * dim;
    const x_t* xr = x + row * dim;
    const float r = rstd[row];
    float dot = 0.0f;
    for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
      float gs[N], xs[N], ws[N];
      load_vec<N>(gr + v * N, gs);
      load_vec<N>(xr + v * N, xs);
      load_vec<N>(weight + v * N, ws);
#pragma unroll
      for (int k = 0; k < N; ++k) dot += gs[k] * ws[k] * xs[k];
    }
    dot = block_sum(dot, scratch);
    const float coef = r * r * r * dot * inv_dim;
    x_t* dxr = grad_x + row * dim;
    for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
      float gs[N], xs[N], ws[N], dx[N], dw[N];
      load_vec<N>(gr + v * N, gs);
      load_vec<N>(xr + v * N, xs);
      load_vec<N>(weight + v * N, ws);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        dx[k] = r * ws[k] * gs[k] - coef * xs[k];
        dw[k] = gs[k] * (xs[k] * r);
      }
      if constexpr (kResidual) {
        if (grad_sum != nullptr) {
          float gsum[N];
          load_vec<N>(grad_sum + row * dim + v * N, gsum);
#pragma unroll
          for (int k = 0; k < N; ++k) dx[k] += gsum[k];
        }
        if (grad_x2 != nullptr) store_vec<N>(grad_x2 + row * dim + v * N, dx);
      }
      store_vec<N>(dxr + v * N, dx);
      accumulate<N>(acc + v * N, dw);
    }
  }
  if (acc_in_smem) {
    // Same ownership as the accumulation: no barrier needed before the copy.
    for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
#pragma unroll
      for (int k = 0; k < N; ++k) block_partial[v * N + k] = acc[v * N + k];
    }
  }
}

inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// Enough warps to cover a row's vectors once, at most 256 (more rows per SM beats wider blocks
// for these sizes), at least one warp.
inline int threads_for(int64_t n_vec) {
  const int64_t warps = std::min<int64_t>(8, std::max<int64_t>(1, (n_vec + 31) / 32));
  return static_cast<int>(warps * 32);
}

// Blocks to keep every SM full (2048 resident threads, 32 resident blocks on Hopper), capped by
// the row count since a block owns whole rows.
inline int64_t blocks_for(int64_t rows, int threads) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t per_sm = std::min<int64_t>(32, 2048 / threads);
  return std::max<int64_t>(1, std::min<int64_t>(rows, sms * per_sm));
}

void check_floating(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK(t.is_cuda(), fn, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), fn, ": ", name,
              " must be fp32, bf16 or fp16, got ", t.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x_in,
                                                    const at::Tensor& weight_in, double eps,
                                                    at::ScalarType out_dtype) {
  check_floating(x_in, "rms_norm_forward", "x");
  check_floating(weight_in, "rms_norm_forward", "weight");
  TORCH_CHECK(at::isFloatingType(out_dtype), "rms_norm_forward: out_dtype must be floating, got ",
              out_dtype);
  TORCH_CHECK(x_in.dim() >= 1, "rms_norm_forward: x must have a last dimension");
  const int64_t dim = x_in.size(-1);
  TORCH_CHECK(dim > 0, "rms_norm_forward: the normalised dimension is empty");
  TORCH_CHECK(weight_in.dim() == 1 && weight_in.size(0) == dim,
              "rms_norm_forward: weight must be [", dim, "], got ", weight_in.sizes());
  TORCH_CHECK(weight_in.device() == x_in.device(), "rms_norm_forward: x (", x_in.device(),
              ") and weight (", weight_in.device(), ") must be on one device");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.to(at::kFloat).contiguous();
  const int64_t rows = x.numel() / dim;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, rstd};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::ScalarType x_dtype = x.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x_dtype, "rms_norm_forward", [&] {
    using x_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "rms_norm_forward_y", [&] {
      using y_t = scalar_t;
      constexpr int kVec = static_cast<int>(16 / sizeof(x_t));
      const bool vec = dim % kVec == 0 && aligned(x.const_data_ptr(), 16) &&
                       aligned(y.const_data_ptr(), kVec * sizeof(y_t)) &&
                       aligned(weight.const_data_ptr(), kVec * sizeof(float));
      const int64_t n_vec = vec ? dim / kVec : dim;
      const int threads = threads_for(n_vec);
      const unsigned blocks = static_cast<unsigned>(blocks_for(rows, threads));
      if (vec) {
        rms_norm_forward_kernel<x_t, y_t, kVec><<<blocks, threads, 0, stream>>>(
            x.const_data_ptr<x_t>(), weight.const_data_ptr<float>(), y.mutable_data_ptr<y_t>(),
            rstd.mutable_data_ptr<float>(), rows, dim, static_cast<float>(eps));
      } else {
        rms_norm_forward_kernel<x_t, y_t, 1><<<blocks, threads, 0, stream>>>(
            x.const_data_ptr<x_t>(), weight.const_data_ptr<float>(), y.mutable_data_ptr<y_t>(),
            rstd.mutable_data_ptr<float>(), rows, dim, static_cast<float>(eps));
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {y, rstd};
}

namespace {

// The backward of both norms: grad_sum undefined and delta_dtype == x's dtype for the plain one.
// Returns (d x, d delta: d x again in delta_dtype, written by the same pass when that differs
// from x's dtype, d weight).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(
    const char* fn, const at::Tensor& grad_y_in, const at::Tensor& grad_sum_in,
    const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& rstd_in,
    at::ScalarType delta_dtype) {
  check_floating(grad_y_in, fn, "grad_y");
  check_floating(x_in, fn, "x");
  check_floating(weight_in, fn, "weight");
  TORCH_CHECK(at::isFloatingType(delta_dtype), fn, ": the delta's dtype must be floating, got ",
              delta_dtype);
  TORCH_CHECK(x_in.dim() >= 1, fn, ": x must have a last dimension");
  const int64_t dim = x_in.size(-1);
  TORCH_CHECK(dim > 0, fn, ": the normalised dimension is empty");
  TORCH_CHECK(grad_y_in.sizes() == x_in.sizes(), fn, ": grad_y ", grad_y_in.sizes(),
              " must have x's shape ", x_in.sizes());
  TORCH_CHECK(weight_in.dim() == 1 && weight_in.size(0) == dim, fn, ": weight must be [", dim,
              "], got ", weight_in.sizes());
  const int64_t rows = x_in.numel() / dim;
  TORCH_CHECK(rstd_in.is_cuda() && rstd_in.scalar_type() == at::kFloat && rstd_in.numel() == rows,
              fn, ": rstd must be fp32 CUDA [", rows, "], got ", rstd_in.scalar_type(), " ",
              rstd_in.sizes(), " on ", rstd_in.device());
  TORCH_CHECK(grad_y_in.device() == x_in.device() && weight_in.device() == x_in.device() &&
                  rstd_in.device() == x_in.device(),
              fn, ": grad_y, x, weight and rstd must be on one device");
  const bool residual = grad_sum_in.defined();
  if (residual) {
    TORCH_CHECK(grad_sum_in.sizes() == x_in.sizes() && grad_sum_in.device() == x_in.device(), fn,
                ": grad_sum ", grad_sum_in.sizes(), " on ", grad_sum_in.device(),
                " must have the sum's shape ", x_in.sizes(), " and device");
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor grad_y = grad_y_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.to(at::kFloat).contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor grad_sum =
      residual ? grad_sum_in.to(x.scalar_type()).contiguous() : at::Tensor();
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  const bool second = delta_dtype != x.scalar_type();
  at::Tensor grad_delta = second ? at::empty(x.sizes(), x.options().dtype(delta_dtype)) : grad_x;
  if (rows == 0) {
    if (residual) {
      grad_x.copy_(grad_sum);
      if (second) grad_delta.copy_(grad_sum);
    }
    return {grad_x, grad_delta, at::zeros_like(weight_in, at::MemoryFormat::Contiguous)};
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor partial;
  const at::ScalarType x_dtype = x.scalar_type();
  const at::ScalarType gy_dtype = grad_y.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x_dtype, "rms_norm_backward", [&] {
    using x_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gy_dtype, "rms_norm_backward_g", [&] {
      using gy_t = scalar_t;
      constexpr int kVec = static_cast<int>(16 / sizeof(x_t));
      // Launches the kernel for one output type of the second gradient (o_t).
      auto launch = [&](auto o_tag, auto residual_tag) {
        using o_t = decltype(o_tag);
        constexpr bool kResidual = decltype(residual_tag)::value;
        const bool vec = dim % kVec == 0 && aligned(x.const_data_ptr(), 16) &&
                         aligned(grad_x.const_data_ptr(), 16) &&
                         aligned(grad_y.const_data_ptr(), kVec * sizeof(gy_t)) &&
                         aligned(weight.const_data_ptr(), kVec * sizeof(float)) &&
                         (!residual || aligned(grad_sum.const_data_ptr(), 16)) &&
                         (!second || aligned(grad_delta.const_data_ptr(), kVec * sizeof(o_t)));
        const int64_t n_vec = vec ? dim / kVec : dim;
        const int threads = threads_for(n_vec);
        const int64_t blocks = blocks_for(rows, threads);
        partial = at::empty({blocks, dim}, x.options().dtype(at::kFloat));
        // 48 KiB is what every kernel may take without opting in (less the 128-byte static
        // scratch); wider rows accumulate in `partial`.
        const bool acc_in_smem = dim * static_cast<int64_t>(sizeof(float)) <= 48 * 1024 - 128;
        const size_t smem = acc_in_smem ? static_cast<size_t>(dim) * sizeof(float) : 0;
        const x_t* gsum = residual ? grad_sum.const_data_ptr<x_t>() : nullptr;
        o_t* gx2 = second ? static_cast<o_t*>(grad_delta.mutable_data_ptr()) : nullptr;
        if (vec) {
          rms_norm_backward_kernel<gy_t, x_t, o_t, kVec, kResidual>
              <<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
                  grad_y.const_data_ptr<gy_t>(), x.const_data_ptr<x_t>(),
                  weight.const_data_ptr<float>(), rstd.const_data_ptr<float>(),
                  grad_x.mutable_data_ptr<x_t>(), partial.mutable_data_ptr<float>(), rows, dim,
                  acc_in_smem, gsum, gx2);
        } else {
          rms_norm_backward_kernel<gy_t, x_t, o_t, 1, kResidual>
              <<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
                  grad_y.const_data_ptr<gy_t>(), x.const_data_ptr<x_t>(),
                  weight.const_data_ptr<float>(), rstd.const_data_ptr<float>(),
                  grad_x.mutable_data_ptr<x_t>(), partial.mutable_data_ptr<float>(), rows, dim,
                  acc_in_smem, gsum, gx2);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (!residual && !second) {
        launch(x_t{}, std::false_type{});
      } else {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, delta_dtype,
                                        "rms_norm_backward_o", [&] {
          launch(scalar_t{}, std::true_type{});
        });
      }
    });
  });
  at::Tensor grad_weight = partial.sum(0).to(weight_in.scalar_type());
  return {grad_x, grad_delta, grad_weight};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y,
                                                     const at::Tensor& x,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd) {
  auto [grad_x, grad_delta, grad_weight] = norm_backward(
      "rms_norm_backward", grad_y, at::Tensor(), x, weight, rstd, x.scalar_type());
  (void)grad_delta;
  return {grad_x, grad_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor& residual_in,
                                                                    const at::Tensor& delta_in,
                                                                    const at::Tensor& weight_in,
                                                                    double eps,
                                                                    at::ScalarType out_dtype) {
  const char* fn = "add_rms_norm_forward";
  check_floating(residual_in, fn, "residual");
  check_floating(delta_in, fn, "delta");
  check_floating(weight_in, fn, "weight");
  TORCH_CHECK(at::isFloatingType(out_dtype), fn, ": out_dtype must be floating, got ", out_dtype);
  TORCH_CHECK(residual_in.sizes() == delta_in.sizes(), fn, ": residual ", residual_in.sizes(),
              " and delta ", delta_in.sizes(), " must have one shape");
  TORCH_CHECK(at::promoteTypes(residual_in.scalar_type(), delta_in.scalar_type()) ==
                  residual_in.scalar_type(),
              fn, ": the sum is stored in the residual's dtype, which must be the wider one (",
              residual_in.scalar_type(), " + ", delta_in.scalar_type(), ")");
  TORCH_CHECK(residual_in.dim() >= 1, fn, ": residual must have a last dimension");
  const int64_t dim = residual_in.size(-1);
  TORCH_CHECK(dim > 0, fn, ": the normalised dimension is empty");
  TORCH_CHECK(weight_in.dim() == 1 && weight_in.size(0) == dim, fn, ": weight must be [", dim,
              "], got ", weight_in.sizes());
  TORCH_CHECK(weight_in.device() == residual_in.device() && delta_in.device() == residual_in.device(),
              fn, ": residual, delta and weight must be on one device");
  const c10::cuda::CUDAGuard guard(residual_in.device());
  const at::Tensor residual = residual_in.contiguous();
  const at::Tensor delta = delta_in.contiguous();
  const at::Tensor weight = weight_in.to(at::kFloat).contiguous();
  const int64_t rows = residual.numel() / dim;
  at::Tensor sum = at::empty(residual.sizes(), residual.options());
  at::Tensor y = at::empty(residual.sizes(), residual.options().dtype(out_dtype));
  at::Tensor rstd = at::empty({rows}, residual.options().dtype(at::kFloat));
  if (rows == 0) return {sum, y, rstd};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm_forward", [&] {
    using x_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, delta.scalar_type(), "add_rms_d", [&] {
      using d_t = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "add_rms_y", [&] {
        using y_t = scalar_t;
        constexpr int kVec = static_cast<int>(16 / sizeof(x_t));
        const bool vec = dim % kVec == 0 && aligned(residual.const_data_ptr(), 16) &&
                         aligned(sum.const_data_ptr(), 16) &&
                         aligned(delta.const_data_ptr(), kVec * sizeof(d_t)) &&
                         aligned(y.const_data_ptr(), kVec * sizeof(y_t)) &&
                         aligned(weight.const_data_ptr(), kVec * sizeof(float));
        const int64_t n_vec = vec ? dim / kVec : dim;
        const int threads = threads_for(n_vec);
        const unsigned blocks = static_cast<unsigned>(blocks_for(rows, threads));
        if (vec) {
          add_rms_norm_forward_kernel<x_t, d_t, y_t, kVec><<<blocks, threads, 0, stream>>>(
              residual.const_data_ptr<x_t>(), delta.const_data_ptr<d_t>(),
              weight.const_data_ptr<float>(), sum.mutable_data_ptr<x_t>(),
              y.mutable_data_ptr<y_t>(), rstd.mutable_data_ptr<float>(), rows, dim,
              static_cast<float>(eps));
        } else {
          add_rms_norm_forward_kernel<x_t, d_t, y_t, 1><<<blocks, threads, 0, stream>>>(
              residual.const_data_ptr<x_t>(), delta.const_data_ptr<d_t>(),
              weight.const_data_ptr<float>(), sum.mutable_data_ptr<x_t>(),
              y.mutable_data_ptr<y_t>(), rstd.mutable_data_ptr<float>(), rows, dim,
              static_cast<float>(eps));
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {sum, y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_backward(
    const at::Tensor& grad_y, const at::Tensor& grad_sum, const at::Tensor& sum,
    const at::Tensor& weight, const at::Tensor& rstd, at::ScalarType delta_dtype) {
  return norm_backward("add_rms_norm_backward", grad_y, grad_sum, sum, weight, rstd, delta_dtype);
}

}  // namespace loom::nn::cuda
