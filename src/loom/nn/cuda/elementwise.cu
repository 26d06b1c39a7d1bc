// SwiGLU and rotate-half RoPE (declared in kernels.h). Both are memory bound: each kernel reads
// its inputs once with 16-byte vector loads where alignment allows and does its math in fp32.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "loom/nn/cuda/kernels.h"

namespace loom::nn::cuda {
namespace {

// A load or store of N elements as one instruction (two for 32 bytes) needs the type's alignment
// to be the whole vector's.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T)) > 0 ? static_cast<int>(16 / sizeof(T)) : 1;
}

inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

constexpr int kThreads = 256;

// Enough resident blocks to fill every SM (2048 threads each on Hopper); a grid-stride loop covers
// the rest, so huge tensors do not launch millions of short-lived blocks.
inline int64_t elementwise_blocks(int64_t work_items) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t cap = static_cast<int64_t>(sms) * (2048 / kThreads);
  return std::max<int64_t>(1, std::min<int64_t>((work_items + kThreads - 1) / kThreads, cap));
}

__device__ __forceinline__ float sigmoidf_(float g) { return 1.0f / (1.0f + __expf(-g)); }

// ---- SwiGLU ------------------------------------------------------------------------------------

// Vectors of N elements over the first n / N * N elements; the last n % N (N > 1 only) go to the
// first threads one element each.
template <typename scalar_t, int N>
__global__ void swiglu_forward_kernel(const scalar_t* __restrict__ gate,
                                      const scalar_t* __restrict__ up, scalar_t* __restrict__ out,
                                      int64_t n) {
  using V = Vec<scalar_t, N>;
  const int64_t n_vec = n / N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < n_vec; i += stride) {
    const V g = reinterpret_cast<const V*>(gate)[i];
    const V u = reinterpret_cast<const V*>(up)[i];
    V y;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float gf = static_cast<float>(g.v[k]);
      y.v[k] = static_cast<scalar_t>(gf * sigmoidf_(gf) * static_cast<float>(u.v[k]));
    }
    reinterpret_cast<V*>(out)[i] = y;
  }
  const int64_t tail = n_vec * N + first;
  if (tail < n) {
    const float gf = static_cast<float>(gate[tail]);
    out[tail] = static_cast<scalar_t>(gf * sigmoidf_(gf) * static_cast<float>(up[tail]));
  }
}

// d silu(g) / dg = s * (1 + g * (1 - s)), s = sigmoid(g).
template <typename scalar_t, int N>
__global__ void swiglu_backward_kernel(const scalar_t* __restrict__ grad_out,
                                       const scalar_t* __restrict__ gate,
                                       const scalar_t* __restrict__ up,
                                       scalar_t* __restrict__ grad_gate,
                                       scalar_t* __restrict__ grad_up, int64_t n) {
  using V = Vec<scalar_t, N>;
  const int64_t n_vec = n / N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < n_vec; i += stride) {
    const V dy = reinterpret_cast<const V*>(grad_out)[i];
    const V g = reinterpret_cast<const V*>(gate)[i];
    const V u = reinterpret_cast<const V*>(up)[i];
    V dg, du;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float dyf = static_cast<float>(dy.v[k]);
      const float gf = static_cast<float>(g.v[k]);
      const float s = sigmoidf_(gf);
      dg.v[k] = static_cast<scalar_t>(dyf * static_cast<float>(u.v[k]) * s *
                                      (1.0f + gf * (1.0f - s)));
      du.v[k] = static_cast<scalar_t>(dyf * gf * s);
    }
    reinterpret_cast<V*>(grad_gate)[i] = dg;
    reinterpret_cast<V*>(grad_up)[i] = du;
  }
  const int64_t tail = n_vec * N + first;
  if (tail < n) {
    const float dyf = static_cast<float>(grad_out[tail]);
    const float gf = static_cast<float>(gate[tail]);
    const float s = sigmoidf_(gf);
    grad_gate[tail] =
        static_cast<scalar_t>(dyf * static_cast<float>(up[tail]) * s * (1.0f + gf * (1.0f - s)));
    grad_up[tail] = static_cast<scalar_t>(dyf * gf * s);
  }
}

void check_floating_cuda(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK(t.is_cuda(), fn, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kHalf || t.scalar_type() == at::kDouble,
              fn, ": ", name, " must be fp32, bf16 or fp16, got ", t.scalar_type());
}

// ---- RoPE --------------------------------------------------------------------------------------

// One work item: N elements of the first half of a row and the N facing them in the second half,
// which is everything their outputs depend on. rows are (b, t, h) in x's logical order; out is
// contiguous. Forward: out = x * c0 + swap(x) * c1. Inverse: the transpose of that map,
// out[j] = x[j] * c0[j] + x[swap(j)] * c1[swap(j)]; with the sign-folded cache (c1 = [-sin, sin],
// c0 = [cos, cos]) that is x * cos - swap(x) * sin, the rotation by -angle, and it is exactly the
// gradient of the forward map for any cache.
template <typename scalar_t, int N, typename index_t>
__global__ void rope_kernel(const scalar_t* __restrict__ x, const float* __restrict__ cache,
                            scalar_t* __restrict__ out, index_t items, index_t per_row,
                            index_t seq, index_t heads, int64_t stride_b, int64_t stride_t,
                            int64_t stride_h, index_t dim, index_t cache_len, bool inverse) {
  using V = Vec<scalar_t, N>;
  using F = Vec<float, N>;
  const index_t half = dim / 2;
  const float* cos_base = cache;
  const float* sin_base = cache + cache_len * dim;
  const index_t block = static_cast<index_t>(blockDim.x);
  const index_t stride = static_cast<index_t>(gridDim.x) * block;
  for (index_t item = static_cast<index_t>(blockIdx.x) * block + static_cast<index_t>(threadIdx.x);
       item < items; item += stride) {
    const index_t row = item / per_row;
    const index_t i = (item - row * per_row) * N;
    const index_t h = row % heads;
    const index_t bt = row / heads;
    const index_t t = bt % seq;
    const index_t b = bt / seq;
    const scalar_t* xr = x + b * stride_b + t * stride_t + h * stride_h;
    scalar_t* outr = out + row * dim;
    const float* cr = cos_base + t * dim;
    const float* sr = sin_base + t * dim;
    const V x1 = *reinterpret_cast<const V*>(xr + i);
    const V x2 = *reinterpret_cast<const V*>(xr + half + i);
    const F cos_lo = *reinterpret_cast<const F*>(cr + i);
    const F cos_hi = *reinterpret_cast<const F*>(cr + half + i);
    const F sin_lo = *reinterpret_cast<const F*>(sr + i);
    const F sin_hi = *reinterpret_cast<const F*>(sr + half + i);
    V y1, y2;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float a = static_cast<float>(x1.v[k]);
      const float bb = static_cast<float>(x2.v[k]);
      // Forward: first half pairs with sin[i], second with sin[half + i]; inverse swaps them.
      const float sa = inverse ? sin_hi.v[k] : sin_lo.v[k];
      const float sb = inverse ? sin_lo.v[k] : sin_hi.v[k];
      y1.v[k] = static_cast<scalar_t>(a * cos_lo.v[k] + bb * sa);
      y2.v[k] = static_cast<scalar_t>(bb * cos_hi.v[k] + a * sb);
    }
    *reinterpret_cast<V*>(outr + i) = y1;
    *reinterpret_cast<V*>(outr + half + i) = y2;
  }
}

template <typename scalar_t, int N, typename index_t>
void launch_rope(const at::Tensor& x, const at::Tensor& cache, at::Tensor& out, bool inverse) {
  const int64_t batch = x.size(0), seq = x.size(1), heads = x.size(2), dim = x.size(3);
  const int64_t per_row = dim / 2 / N;
  const int64_t items = batch * seq * heads * per_row;
  const int64_t blocks = elementwise_blocks(items);
  rope_kernel<scalar_t, N, index_t>
      <<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<scalar_t>(), cache.const_data_ptr<float>(),
          out.mutable_data_ptr<scalar_t>(), static_cast<index_t>(items),
          static_cast<index_t>(per_row), static_cast<index_t>(seq), static_cast<index_t>(heads),
          x.stride(0), x.stride(1), x.stride(2), static_cast<index_t>(dim),
          static_cast<index_t>(cache.size(1)), inverse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  check_floating_cuda(gate, "swiglu_forward", "gate");
  check_floating_cuda(up, "swiglu_forward", "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "swiglu_forward: gate ", gate.sizes(), " and up ",
              up.sizes(), " must have one shape");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type(), "swiglu_forward: gate (", gate.scalar_type(),
              ") and up (", up.scalar_type(), ") must have one dtype");
  TORCH_CHECK(gate.device() == up.device(), "swiglu_forward: gate and up on different devices");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
  const int64_t n = g.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "swiglu_forward", [&] {
    constexpr int kVec = vec_width<scalar_t>();
    const bool vec = aligned(g.const_data_ptr(), 16) && aligned(u.const_data_ptr(), 16) &&
                     aligned(out.const_data_ptr(), 16);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (vec) {
      swiglu_forward_kernel<scalar_t, kVec>
          <<<static_cast<unsigned>(elementwise_blocks(n / kVec + n % kVec)), kThreads, 0, stream>>>(
              g.const_data_ptr<scalar_t>(), u.const_data_ptr<scalar_t>(),
              out.mutable_data_ptr<scalar_t>(), n);
    } else {
      swiglu_forward_kernel<scalar_t, 1>
          <<<static_cast<unsigned>(elementwise_blocks(n)), kThreads, 0, stream>>>(
              g.const_data_ptr<scalar_t>(), u.const_data_ptr<scalar_t>(),
              out.mutable_data_ptr<scalar_t>(), n);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_out,
                                                   const at::Tensor& gate, const at::Tensor& up) {
  check_floating_cuda(grad_out, "swiglu_backward", "grad_out");
  check_floating_cuda(gate, "swiglu_backward", "gate");
  check_floating_cuda(up, "swiglu_backward", "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && grad_out.sizes() == gate.sizes(),
              "swiglu_backward: grad_out ", grad_out.sizes(), ", gate ", gate.sizes(), " and up ",
              up.sizes(), " must have one shape");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type(), "swiglu_backward: gate (",
              gate.scalar_type(), ") and up (", up.scalar_type(), ") must have one dtype");
  TORCH_CHECK(gate.device() == up.device() && grad_out.device() == gate.device(),
              "swiglu_backward: grad_out, gate and up must be on one device");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  // The kernel reads one dtype; a mismatched gradient (rare) costs one cast.
  const at::Tensor dy = grad_out.to(g.scalar_type()).contiguous();
  at::Tensor grad_gate = at::empty_like(g, at::MemoryFormat::Contiguous);
  at::Tensor grad_up = at::empty_like(g, at::MemoryFormat::Contiguous);
  const int64_t n = g.numel();
  if (n == 0) return {grad_gate, grad_up};
  const at::ScalarType dtype = g.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "swiglu_backward", [&] {
    constexpr int kVec = vec_width<scalar_t>();
    const bool vec = aligned(g.const_data_ptr(), 16) && aligned(u.const_data_ptr(), 16) &&
                     aligned(dy.const_data_ptr(), 16) && aligned(grad_gate.const_data_ptr(), 16) &&
                     aligned(grad_up.const_data_ptr(), 16);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (vec) {
      swiglu_backward_kernel<scalar_t, kVec>
          <<<static_cast<unsigned>(elementwise_blocks(n / kVec + n % kVec)), kThreads, 0, stream>>>(
              dy.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
              u.const_data_ptr<scalar_t>(), grad_gate.mutable_data_ptr<scalar_t>(),
              grad_up.mutable_data_ptr<scalar_t>(), n);
    } else {
      swiglu_backward_kernel<scalar_t, 1>
          <<<static_cast<unsigned>(elementwise_blocks(n)), kThreads, 0, stream>>>(
              dy.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
              u.const_data_ptr<scalar_t>(), grad_gate.mutable_data_ptr<scalar_t>(),
              grad_up.mutable_data_ptr<scalar_t>(), n);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {grad_gate, grad_up};
}

at::Tensor rope_forward(const at::Tensor& x_in, const at::Tensor& cache_in, bool inverse) {
  check_floating_cuda(x_in, "rope_forward", "x");
  TORCH_CHECK(cache_in.is_cuda() && cache_in.device() == x_in.device(),
              "rope_forward: cache must be on x's device (", x_in.device(), "), got ",
              cache_in.device());
  TORCH_CHECK(x_in.dim() == 4, "rope_forward: x must be [B, T, H, D], got ", x_in.sizes());
  TORCH_CHECK(cache_in.scalar_type() == at::kFloat, "rope_forward: cache must be fp32, got ",
              cache_in.scalar_type());
  const int64_t seq = x_in.size(1), dim = x_in.size(3);
  TORCH_CHECK(dim % 2 == 0, "rope_forward: head dim must be even, got ", dim);
  TORCH_CHECK(cache_in.dim() == 3 && cache_in.size(0) == 2 && cache_in.size(1) >= seq &&
                  cache_in.size(2) == dim,
              "rope_forward: cache must be [2, >=", seq, ", ", dim, "], got ", cache_in.sizes());
  const c10::cuda::CUDAGuard guard(x_in.device());
  // Only the last dim must be unit-stride; the kernel walks B, T and H through x's own strides.
  const at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const at::Tensor cache = cache_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_forward", [&] {
    constexpr int kVec = vec_width<scalar_t>();
    const int64_t half = dim / 2;
    const int64_t es = static_cast<int64_t>(sizeof(scalar_t));
    // Every row start of x and out, and half, must sit on a whole vector; the fp32 cache needs
    // kVec * 4 bytes, which half % kVec == 0 and dim = 2 * half give for its rows.
    const bool vec = half % kVec == 0 && aligned(x.const_data_ptr(), kVec * es) &&
                     x.stride(0) % kVec == 0 && x.stride(1) % kVec == 0 &&
                     x.stride(2) % kVec == 0 && aligned(out.const_data_ptr(), kVec * es) &&
                     aligned(cache.const_data_ptr(), kVec * 4);
    // 32-bit index math when every offset fits (the common case): the per-item divisions are
    // several times cheaper.
    const int64_t max_offset = std::max<int64_t>(
        {out.numel(), cache.numel(),
         (x.size(0) - 1) * std::abs(x.stride(0)) + (x.size(1) - 1) * std::abs(x.stride(1)) +
             (x.size(2) - 1) * std::abs(x.stride(2)) + dim});
    const bool small = max_offset < (int64_t{1} << 31) && x.stride(0) >= 0 && x.stride(1) >= 0 &&
                       x.stride(2) >= 0;
    if (vec && small) {
      launch_rope<scalar_t, kVec, int32_t>(x, cache, out, inverse);
    } else if (vec) {
      launch_rope<scalar_t, kVec, int64_t>(x, cache, out, inverse);
    } else if (small) {
      launch_rope<scalar_t, 1, int32_t>(x, cache, out, inverse);
    } else {
      launch_rope<scalar_t, 1, int64_t>(x, cache, out, inverse);
    }
  });
  return out;
}

}  // namespace loom::nn::cuda
