// Loom's AdamW update kernel (adamw_kernel.h): one pass, 16-byte vectors where the four operands
// are aligned, scalar elements otherwise (e.g. an FSDP shard's no-decay slices at odd offsets).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>

#include "loom/optim/cuda/adamw_kernel.h"

namespace loom::optim::cuda {
namespace {

constexpr int kThreads = 256;

struct Hyper {
  float lr, beta1, beta2, weight_decay, eps;
};

// The step's scalars, from the device-side count: what torch.optim.AdamW computes on the host.
struct StepScalars {
  float decay;      // 1 - lr * weight_decay
  float step_size;  // lr / (1 - beta1^t)
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float inv_scale;  // 1 / grad_scale (1 without one)
};

__device__ __forceinline__ StepScalars step_scalars(const Hyper& h, const float* step, const float* grad_scale) {
  const double t = static_cast<double>(*step);
  StepScalars s;
  s.decay = 1.0f - h.lr * h.weight_decay;
  s.step_size = static_cast<float>(static_cast<double>(h.lr) / (1.0 - pow(static_cast<double>(h.beta1), t)));
  s.bc2_sqrt = static_cast<float>(sqrt(1.0 - pow(static_cast<double>(h.beta2), t)));
  s.inv_scale = grad_scale ? 1.0f / *grad_scale : 1.0f;
  return s;
}

__device__ __forceinline__ void update(float& p, float g, float& m, float& v, const Hyper& h, const StepScalars& s) {
  g *= s.inv_scale;
  p *= s.decay;
  m = h.beta1 * m + (1.0f - h.beta1) * g;
  v = h.beta2 * v + (1.0f - h.beta2) * g * g;
  const float denom = sqrtf(v) / s.bc2_sqrt + h.eps;
  p -= s.step_size * m / denom;
}

template <bool kVector>
__global__ void __launch_bounds__(kThreads) adamw_kernel(float* __restrict__ param, const float* __restrict__ grad,
                                                         float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                                                         int64_t n, const float* __restrict__ step, Hyper h,
                                                         const float* __restrict__ grad_scale,
                                                         const float* __restrict__ found_inf) {
  if (found_inf && *found_inf == 1.0f) return;
  const StepScalars s = step_scalars(h, step, grad_scale);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVector) {
    const int64_t n_vec = n / 4;
    for (int64_t i = first; i < n_vec; i += stride) {
      float4 p = reinterpret_cast<float4*>(param)[i];
      const float4 g = reinterpret_cast<const float4*>(grad)[i];
      float4 m = reinterpret_cast<float4*>(exp_avg)[i];
      float4 v = reinterpret_cast<float4*>(exp_avg_sq)[i];
      update(p.x, g.x, m.x, v.x, h, s);
      update(p.y, g.y, m.y, v.y, h, s);
      update(p.z, g.z, m.z, v.z, h, s);
      update(p.w, g.w, m.w, v.w, h, s);
      reinterpret_cast<float4*>(param)[i] = p;
      reinterpret_cast<float4*>(exp_avg)[i] = m;
      reinterpret_cast<float4*>(exp_avg_sq)[i] = v;
    }
    done = n_vec * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    update(p, grad[i], m, v, h, s);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void check(const at::Tensor& t, const at::Tensor& param, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == param.numel() &&
                  t.device() == param.device(),
              "loom AdamW kernel: ", what, " must be a contiguous float32 tensor of ", param.numel(),
              " elements on ", param.device(), ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

const float* scalar_ptr(const at::Tensor& t, const at::Tensor& param, const char* what) {
  if (!t.defined()) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1 && t.device() == param.device(),
              "loom AdamW kernel: ", what, " must be a float32 scalar on ", param.device());
  return t.data_ptr<float>();
}

}  // namespace

void adamw_update_(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                   const at::Tensor& step, double lr, double beta1, double beta2, double weight_decay,
                   double eps, const at::Tensor& grad_scale, const at::Tensor& found_inf) {
  TORCH_CHECK(param.is_cuda(), "loom AdamW kernel: the parameter must be on a CUDA device");
  check(param, param, "the parameter");
  check(grad, param, "the gradient");
  check(exp_avg, param, "exp_avg");
  check(exp_avg_sq, param, "exp_avg_sq");
  const int64_t n = param.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard device_guard(param.device());
  const float* step_ptr = scalar_ptr(step, param, "the step count");
  TORCH_CHECK(step_ptr, "loom AdamW kernel: the step count is undefined");
  const float* scale_ptr = scalar_ptr(grad_scale, param, "grad_scale");
  const float* inf_ptr = scalar_ptr(found_inf, param, "found_inf");
  const Hyper h{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                static_cast<float>(weight_decay), static_cast<float>(eps)};
  const bool vector = aligned16(param.data_ptr()) && aligned16(grad.data_ptr()) && aligned16(exp_avg.data_ptr()) &&
                      aligned16(exp_avg_sq.data_ptr());
  const int64_t items = vector ? std::max<int64_t>(n / 4, 1) : n;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>((items + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * (2048 / kThreads)));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (vector) {
    adamw_kernel<true><<<blocks, kThreads, 0, stream>>>(param.data_ptr<float>(), grad.data_ptr<float>(),
                                                        exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), n,
                                                        step_ptr, h, scale_ptr, inf_ptr);
  } else {
    adamw_kernel<false><<<blocks, kThreads, 0, stream>>>(param.data_ptr<float>(), grad.data_ptr<float>(),
                                                         exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), n,
                                                         step_ptr, h, scale_ptr, inf_ptr);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace loom::optim::cuda
