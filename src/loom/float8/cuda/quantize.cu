// Float8 quantization kernels (declared in quantize.h): a row or column abs-max pass, then one pass
// that turns each amax into its scale and writes the float8 data, transposed through shared memory
// where the operand is a column-major view.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "loom/float8/cuda/quantize.h"

namespace loom::float8::cuda {
namespace {

// torchao's EPS for amax (float8.cpp's kAmaxFloor): a zero row gets a large but finite scale.
constexpr double kAmaxFloor = 1e-12;

// max that propagates NaN as ATen's amax does (fmaxf would drop it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Every thread of the block gets the block's max; blockDim.x a multiple of 32.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x >> 5);
  return warp_max(lane < warps ? scratch[lane] : 0.0f);
}

// A non-negative float (or NaN, whose bits exceed every finite one's and +inf's) as an int orders
// as the float does, so atomicMax on the bits is a float max.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

// scale = fmax / max(amax, 1e-12) in fp64, rounded to fp32; row-wise: rounded down to a power of 2
// with the same log2f / exp2f ATen's log2 / exp2 kernels call (float8.cpp's composition).
__device__ __forceinline__ float scale_of(float amax, double fmax, bool pow2) {
  const double a = static_cast<double>(amax);
  // ATen's clamp_min propagates NaN; fmax() would not.
  const double clamped = a != a ? a : (a < kAmaxFloor ? kAmaxFloor : a);
  float s = static_cast<float>(fmax / clamped);
  if (pow2) s = exp2f(floorf(log2f(s)));
  return s;
}

template <typename out_t>
__device__ __forceinline__ out_t to_float8(float v, float fmax) {
  // clamp as ATen's does: NaN stays NaN.
  const float c = v != v ? v : (v < -fmax ? -fmax : (v > fmax ? fmax : v));
  return out_t(c);
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// One block per row (grid-stride): amax of |t[row, :]|.
template <typename in_t, int N>
__global__ void amax_rows_kernel(const in_t* __restrict__ t, float* __restrict__ amax, int64_t rows, int64_t cols) {
  __shared__ float scratch[32];
  const int64_t n_vec = cols / N;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const in_t* r = t + row * cols;
    float m = 0.0f;
    for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
      const Vec<in_t, N> x = *reinterpret_cast<const Vec<in_t, N>*>(r + v * N);
#pragma unroll
      for (int k = 0; k < N; ++k) m = nan_max(m, fabsf(static_cast<float>(x.v[k])));
    }
    m = block_max(m, scratch);
    if (threadIdx.x == 0) amax[row] = m;
  }
}

// Blocks of 32 x 8 threads over tiles of 32 columns and kRowsPerBlock rows: each thread keeps the
// max of its column over its rows, the block reduces its 8 partial maxima per column in shared
// memory and folds them into amax[col] (zeroed first) with one atomic.
constexpr int kRowsPerBlock = 256;

template <typename in_t>
__global__ void amax_cols_kernel(const in_t* __restrict__ t, float* __restrict__ amax, int64_t rows, int64_t cols) {
  __shared__ float partial[8][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock;
  const int64_t row_end = row0 + kRowsPerBlock < rows ? row0 + kRowsPerBlock : rows;
  float m = 0.0f;
  if (col < cols) {
    for (int64_t r = row0 + threadIdx.y; r < row_end; r += 8) m = nan_max(m, fabsf(static_cast<float>(t[r * cols + col])));
  }
  partial[threadIdx.y][threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
#pragma unroll
    for (int k = 1; k < 8; ++k) m = nan_max(m, partial[k][threadIdx.x]);
    atomic_max_nonneg(amax + col, m);
  }
}

// Row scales: one block per row (grid-stride) computes its scale, thread 0 writes scale and
// 1 / scale, and the block writes the row's float8 values.
template <typename in_t, typename out_t, int N>
__global__ void quantize_rows_kernel(const in_t* __restrict__ t, const float* __restrict__ amax, out_t* __restrict__ out,
                                     float* __restrict__ scale, float* __restrict__ inverse, int64_t rows, int64_t cols,
                                     bool per_tensor, double fmax, bool pow2) {
  const int64_t n_vec = cols / N;
  const float fmax_f = static_cast<float>(fmax);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float s = scale_of(amax[per_tensor ? 0 : row], fmax, pow2);
    if (threadIdx.x == 0 && (!per_tensor || row == 0)) {
      const int64_t i = per_tensor ? 0 : row;
      scale[i] = s;
      inverse[i] = 1.0f / s;
    }
    const in_t* r = t + row * cols;
    out_t* o = out + row * cols;
    for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) {
      const Vec<in_t, N> x = *reinterpret_cast<const Vec<in_t, N>*>(r + v * N);
      Vec<out_t, N> y;
#pragma unroll
      for (int k = 0; k < N; ++k) y.v[k] = to_float8<out_t>(static_cast<float>(x.v[k]) * s, fmax_f);
      *reinterpret_cast<Vec<out_t, N>*>(o + v * N) = y;
    }
  }
}

// Column scales, transposed output: blocks of 32 x 8 threads over 32 x 32 tiles. The tile is read
// row by row (coalesced along t's columns) into shared memory and written column by column
// (coalesced along out's rows, which are t's columns).
template <typename in_t, typename out_t>
__global__ void quantize_cols_transposed_kernel(const in_t* __restrict__ t, const float* __restrict__ amax,
                                                out_t* __restrict__ out, float* __restrict__ scale,
                                                float* __restrict__ inverse, int64_t rows, int64_t cols,
                                                bool per_tensor, double fmax, bool pow2) {
  __shared__ float tile[32][33];
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * 32;
  const float fmax_f = static_cast<float>(fmax);
#pragma unroll
  for (int k = 0; k < 32; k += 8) {
    const int64_t r = row0 + threadIdx.y + k;
    const int64_t c = col0 + threadIdx.x;
    tile[threadIdx.y + k][threadIdx.x] = (r < rows && c < cols) ? static_cast<float>(t[r * cols + c]) : 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 32; k += 8) {
    const int64_t c = col0 + threadIdx.y + k;  // out's row
    const int64_t r = row0 + threadIdx.x;       // out's column
    if (c >= cols) continue;
    const float s = scale_of(amax[per_tensor ? 0 : c], fmax, pow2);
    if (r < rows) out[c * rows + r] = to_float8<out_t>(tile[threadIdx.x][threadIdx.y + k] * s, fmax_f);
    if (blockIdx.y == 0 && threadIdx.x == 0 && (!per_tensor || c == 0)) {
      const int64_t i = per_tensor ? 0 : c;
      scale[i] = s;
      inverse[i] = 1.0f / s;
    }
  }
}

inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

inline int threads_for(int64_t n_vec) {
  const int64_t warps = std::min<int64_t>(8, std::max<int64_t>(1, (n_vec + 31) / 32));
  return static_cast<int>(warps * 32);
}

inline int64_t blocks_for(int64_t rows, int threads) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t per_sm = std::min<int64_t>(32, 2048 / threads);
  return std::max<int64_t>(1, std::min<int64_t>(rows, sms * per_sm));
}

void check_input(const at::Tensor& t, const char* fn) {
  TORCH_CHECK(t.is_cuda(), fn, ": t must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), fn, ": t must be a contiguous 2-D tensor, got sizes ", t.sizes(),
              " strides ", t.strides());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()) && t.element_size() <= 4, fn, ": t must be fp32, bf16 or fp16, got ",
              t.scalar_type());
}

// Elements per vector access: 16 bytes of input where the row length and the pointers allow it.
template <typename in_t>
int vector_width(const at::Tensor& t, const void* out) {
  const int n = static_cast<int>(16 / sizeof(in_t));
  if (t.size(1) % n == 0 && aligned(t.data_ptr(), 16) && (out == nullptr || aligned(out, n))) return n;
  return 1;
}

}  // namespace

at::Tensor abs_max(const at::Tensor& t, bool per_column) {
  check_input(t, "float8::cuda::abs_max");
  const c10::cuda::CUDAGuard guard(t.device());
  const int64_t rows = t.size(0), cols = t.size(1);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (per_column) {
    at::Tensor amax = at::zeros({cols}, t.options().dtype(at::kFloat));
    if (rows == 0 || cols == 0) return amax;
    const dim3 block(32, 8);
    const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "float8_amax_cols", [&] {
      amax_cols_kernel<scalar_t><<<grid, block, 0, stream>>>(t.data_ptr<scalar_t>(), amax.data_ptr<float>(), rows, cols);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return amax;
  }
  at::Tensor amax = at::empty({rows}, t.options().dtype(at::kFloat));
  if (rows == 0) return amax;
  if (cols == 0) return amax.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "float8_amax_rows", [&] {
    const int n = vector_width<scalar_t>(t, nullptr);
    const int threads = threads_for(cols / n);
    const int64_t blocks = blocks_for(rows, threads);
    if (n == 16 / static_cast<int>(sizeof(scalar_t))) {
      amax_rows_kernel<scalar_t, 16 / sizeof(scalar_t)><<<blocks, threads, 0, stream>>>(
          t.data_ptr<scalar_t>(), amax.data_ptr<float>(), rows, cols);
    } else {
      amax_rows_kernel<scalar_t, 1><<<blocks, threads, 0, stream>>>(t.data_ptr<scalar_t>(), amax.data_ptr<float>(), rows,
                                                                    cols);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return amax;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& t, const at::Tensor& amax_in,
                                                        bool transpose, bool per_tensor, at::ScalarType dtype,
                                                        double fmax, bool pow2) {
  check_input(t, "float8::cuda::quantize");
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "float8::cuda::quantize: dtype must be float8_e4m3fn or float8_e5m2, got ", dtype);
  const c10::cuda::CUDAGuard guard(t.device());
  const int64_t rows = t.size(0), cols = t.size(1);
  const int64_t n_scales = per_tensor ? 1 : (transpose ? cols : rows);
  const at::Tensor amax = amax_in.to(at::kFloat).contiguous();
  TORCH_CHECK(amax.is_cuda() && amax.numel() == n_scales, "float8::cuda::quantize: amax must hold ", n_scales,
              " values on t's device, got ", amax.sizes());
  at::Tensor out = at::empty(transpose ? at::IntArrayRef{cols, rows} : at::IntArrayRef{rows, cols}, t.options().dtype(dtype));
  at::Tensor scale = at::empty({n_scales}, t.options().dtype(at::kFloat));
  at::Tensor inverse = at::empty({n_scales}, t.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) {
    // No element to write; the scales still follow their amax (ATen's composition gives them).
    if (n_scales > 0) {
      at::Tensor s = (fmax / amax.to(at::kDouble).clamp_min(kAmaxFloor)).to(at::kFloat);
      if (pow2) s = at::exp2(at::floor(at::log2(s)));
      scale.copy_(s);
      inverse.copy_(s.reciprocal());
    }
    return {out, scale, inverse};
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "float8_quantize", [&] {
    auto launch = [&](auto out_tag) {
      using out_t = decltype(out_tag);
      out_t* o = reinterpret_cast<out_t*>(out.data_ptr());
      if (transpose) {
        const dim3 block(32, 8);
        const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + 31) / 32));
        quantize_cols_transposed_kernel<scalar_t, out_t><<<grid, block, 0, stream>>>(
            t.data_ptr<scalar_t>(), amax.data_ptr<float>(), o, scale.data_ptr<float>(), inverse.data_ptr<float>(), rows,
            cols, per_tensor, fmax, pow2);
        return;
      }
      const int n = vector_width<scalar_t>(t, o);
      const int threads = threads_for(cols / n);
      const int64_t blocks = blocks_for(rows, threads);
      if (n == 16 / static_cast<int>(sizeof(scalar_t))) {
        quantize_rows_kernel<scalar_t, out_t, 16 / sizeof(scalar_t)><<<blocks, threads, 0, stream>>>(
            t.data_ptr<scalar_t>(), amax.data_ptr<float>(), o, scale.data_ptr<float>(), inverse.data_ptr<float>(), rows,
            cols, per_tensor, fmax, pow2);
      } else {
        quantize_rows_kernel<scalar_t, out_t, 1><<<blocks, threads, 0, stream>>>(
            t.data_ptr<scalar_t>(), amax.data_ptr<float>(), o, scale.data_ptr<float>(), inverse.data_ptr<float>(), rows,
            cols, per_tensor, fmax, pow2);
      }
    };
    if (dtype == at::kFloat8_e4m3fn) {
      launch(c10::Float8_e4m3fn());
    } else {
      launch(c10::Float8_e5m2());
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, scale, inverse};
}

}  // namespace loom::float8::cuda
