// The classifier's softmax, loss and logit gradient in one kernel over a chunk of logits, in place
// (the idea of llm.c's fused classifier). The ATen composition it replaces makes about seven passes
// over fp32 [chunk, vocab] logits (cast, max, sum-exp, sub, exp, scatter, scale, cast back); this
// kernel reads the compute-dtype logits twice (once for the row's max and sum, once to write the
// gradient, mostly from L2) and writes them once, and never leaves the device.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "loom/nn/cuda/kernels.h"

namespace loom::nn::cuda {
namespace {

constexpr int kThreads = 512;

// Running (max, sum of exp(x - max)) of a set of logits; merging two is exact up to rounding. A
// NaN logit makes the sum NaN (so the loss reports it), never a silently finite loss.
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ void push(MaxSum& acc, float x) {
  if (x > acc.m) {
    acc.s = (acc.m == -INFINITY ? 0.0f : acc.s * __expf(acc.m - x)) + 1.0f;
    acc.m = x;
  } else {
    acc.s += __expf(x - acc.m);  // NaN x lands here (x > m is false) and poisons the sum
  }
}

__device__ MaxSum block_merge(MaxSum v) {
  __shared__ MaxSum warp_results[kThreads / 32];
  __shared__ MaxSum total;
  for (int offset = 16; offset > 0; offset /= 2) {
    MaxSum o{__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)};
    v = merge(v, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_results[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? warp_results[lane] : MaxSum{-INFINITY, 0.0f};
    for (int offset = 16; offset > 0; offset /= 2) {
      MaxSum o{__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)};
      v = merge(v, o);
    }
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// One block per row. kVec > 1 only when every row starts on a 16-byte boundary and holds whole packs.
template <typename T, int kVec>
__global__ void cross_entropy_rows(T* __restrict__ logits, const int64_t* __restrict__ labels,
                                   int64_t vocab, int64_t ignore_index,
                                   const float* __restrict__ scale, float* __restrict__ row_loss,
                                   int* __restrict__ bad_label, bool write_grad) {
  const int64_t row = blockIdx.x;
  T* x = logits + row * vocab;
  const int64_t packs = vocab / kVec;
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, kVec> pk = reinterpret_cast<const Pack<T, kVec>*>(x)[p];
#pragma unroll
    for (int k = 0; k < kVec; ++k) push(acc, static_cast<float>(pk.v[k]));
  }
  const MaxSum stats = block_merge(acc);
  const float lse = stats.m + __logf(stats.s);

  const int64_t label = labels[row];
  const bool in_range = label >= 0 && label < vocab;
  const bool valid = label != ignore_index && in_range;
  if (threadIdx.x == 0) {
    if (label != ignore_index && !in_range) *bad_label = 1;
    // Read before the pass below overwrites the row.
    row_loss[row] = valid ? lse - static_cast<float>(x[label]) : 0.0f;
  }
  if (!write_grad) return;
  __syncthreads();  // x[label] is read above before any thread overwrites it

  const float row_scale = valid ? *scale : 0.0f;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    Pack<T, kVec> pk = reinterpret_cast<const Pack<T, kVec>*>(x)[p];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t j = p * kVec + k;
      const float softmax = __expf(static_cast<float>(pk.v[k]) - lse);
      pk.v[k] = static_cast<T>((softmax - (j == label ? 1.0f : 0.0f)) * row_scale);
    }
    reinterpret_cast<Pack<T, kVec>*>(x)[p] = pk;
  }
}

}  // namespace

void cross_entropy_chunk_(at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index,
                          const at::Tensor& scale, at::Tensor& row_loss, at::Tensor& bad_label,
                          bool write_grad) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous(),
              "cross_entropy_chunk_: logits must be a contiguous 2-D CUDA tensor, got ",
              logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(labels.device() == logits.device() && labels.scalar_type() == at::kLong &&
                  labels.dim() == 1 && labels.size(0) == rows && labels.is_contiguous(),
              "cross_entropy_chunk_: labels must be contiguous int64 [", rows, "] on ",
              logits.device());
  TORCH_CHECK(scale.device() == logits.device() && scale.scalar_type() == at::kFloat &&
                  scale.numel() == 1,
              "cross_entropy_chunk_: scale must be one fp32 value on ", logits.device());
  TORCH_CHECK(row_loss.device() == logits.device() && row_loss.scalar_type() == at::kFloat &&
                  row_loss.is_contiguous() && row_loss.numel() == rows,
              "cross_entropy_chunk_: row_loss must be contiguous fp32 [", rows, "]");
  TORCH_CHECK(bad_label.device() == logits.device() && bad_label.scalar_type() == at::kInt &&
                  bad_label.numel() == 1,
              "cross_entropy_chunk_: bad_label must be one int32 on ", logits.device());
  if (rows == 0 || vocab == 0) return;
  TORCH_CHECK(rows <= INT32_MAX, "cross_entropy_chunk_: too many rows (", rows, ")");
  const c10::cuda::CUDAGuard guard(logits.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "cross_entropy_chunk_", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    scalar_t* data = logits.data_ptr<scalar_t>();
    const bool aligned = vocab % kVec == 0 && reinterpret_cast<uintptr_t>(data) % 16 == 0;
    const dim3 grid(static_cast<unsigned>(rows));
    if (aligned) {
      cross_entropy_rows<scalar_t, kVec><<<grid, kThreads, 0, stream>>>(
          data, labels.data_ptr<int64_t>(), vocab, ignore_index, scale.data_ptr<float>(),
          row_loss.data_ptr<float>(), bad_label.data_ptr<int>(), write_grad);
    } else {
      cross_entropy_rows<scalar_t, 1><<<grid, kThreads, 0, stream>>>(
          data, labels.data_ptr<int64_t>(), vocab, ignore_index, scale.data_ptr<float>(),
          row_loss.data_ptr<float>(), bad_label.data_ptr<int>(), write_grad);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace loom::nn::cuda

#include <c10/cuda/CUDACachingAllocator.h>

namespace loom::nn::cuda {

int64_t allocatable_bytes(int device_index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(
      static_cast<c10::DeviceIndex>(device_index));
  const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t cached_unused =
      stats.reserved_bytes[all].current - stats.allocated_bytes[all].current;
  return static_cast<int64_t>(free) + std::max<int64_t>(0, cached_unused);
}

}  // namespace loom::nn::cuda
