// Loom's CUDA kernels (nn/cuda/kernels.h, optim/cuda/adamw_kernel.h) against the ATen code they
// replace, forward + backward, on the Llama 3 1B shapes for one 8192-token micro-batch in bf16: SwiGLU gate/up
// [8192, 8192], RMSNorm x fp32 [8192, 2048] with fp32 weight and a bf16 output, RoPE q
// [4, 2048, 32, 64]. The compositions run through autograd as the generic path does. Times are
// wall clock between torch::cuda::synchronize() calls over kReps forward+backward passes (so the
// launch queue stays full), reported per pass; bytes_per_second counts the tensors each kernel
// pair must read and write once (the floor the kernels aim at), the same figure for both sides.
//   build/bin/loom_bench_cuda_kernels --benchmark_min_time=1s
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <iostream>
#include <vector>

#include "loom/nn/cuda/kernels.h"
#include "loom/nn/rope.h"
#include "loom/optim/cuda/adamw_kernel.h"

namespace {

constexpr int kReps = 10;
constexpr int64_t kTokens = 8192, kHidden = 2048, kFfn = 8192;
constexpr int64_t kBatch = 4, kSeq = 2048, kHeads = 32, kHeadDim = 64;
constexpr double kEps = 1e-5;

torch::Tensor randn_cuda(at::IntArrayRef shape, c10::ScalarType dtype) {
  return torch::randn(shape, torch::TensorOptions(torch::kCUDA)).to(dtype);
}

// Runs fn kReps times per benchmark iteration and reports the mean time of one.
template <typename F>
void time_passes(benchmark::State& state, int64_t bytes_per_pass, F fn) {
  fn();  // warm-up: allocator, cuBLAS/launch caches
  torch::cuda::synchronize();
  for (auto _ : state) {
    torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < kReps; ++r) fn();
    torch::cuda::synchronize();
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    state.SetIterationTime(elapsed.count() / kReps);
  }
  state.SetBytesProcessed(state.iterations() * bytes_per_pass);
}

// ---- SwiGLU: forward reads gate, up and writes y; backward reads dy, gate, up and writes two.

struct SwiGLUInputs {
  torch::Tensor gate = randn_cuda({kTokens, kFfn}, torch::kBFloat16);
  torch::Tensor up = randn_cuda({kTokens, kFfn}, torch::kBFloat16);
  torch::Tensor grad = randn_cuda({kTokens, kFfn}, torch::kBFloat16);
  int64_t bytes() const { return 8 * gate.numel() * 2; }
};

void BM_SwiGLU_Kernel(benchmark::State& state) {
  SwiGLUInputs in;
  time_passes(state, in.bytes(), [&] {
    const at::Tensor y = loom::nn::cuda::swiglu_forward(in.gate, in.up);
    const auto grads = loom::nn::cuda::swiglu_backward(in.grad, in.gate, in.up);
    benchmark::DoNotOptimize(y.data_ptr());
    benchmark::DoNotOptimize(std::get<0>(grads).data_ptr());
  });
}

void BM_SwiGLU_ATen(benchmark::State& state) {
  SwiGLUInputs in;
  const torch::Tensor gate = in.gate.clone().requires_grad_(true);
  const torch::Tensor up = in.up.clone().requires_grad_(true);
  time_passes(state, in.bytes(), [&] {
    const torch::Tensor y = at::silu(gate) * up;
    const auto grads = torch::autograd::grad({y}, {gate, up}, {in.grad});
    benchmark::DoNotOptimize(grads[0].data_ptr());
  });
}

// ---- RMSNorm: forward reads x (fp32) and writes y (bf16); backward reads dy (bf16), x and writes
// dx (fp32). The weight, rstd and d weight are [2048] / [8192]: left out.

struct RMSNormInputs {
  torch::Tensor x = randn_cuda({kTokens, kHidden}, torch::kFloat32);
  torch::Tensor weight = 1.0 + 0.1 * randn_cuda({kHidden}, torch::kFloat32);
  torch::Tensor grad = randn_cuda({kTokens, kHidden}, torch::kBFloat16);
  int64_t bytes() const { return x.numel() * (4 + 2 + 2 + 4 + 4); }
};

void BM_RMSNorm_Kernel(benchmark::State& state) {
  RMSNormInputs in;
  time_passes(state, in.bytes(), [&] {
    const auto [y, rstd] =
        loom::nn::cuda::rms_norm_forward(in.x, in.weight, kEps, torch::kBFloat16);
    const auto [dx, dw] = loom::nn::cuda::rms_norm_backward(in.grad, in.x, in.weight, rstd);
    benchmark::DoNotOptimize(y.data_ptr());
    benchmark::DoNotOptimize(dx.data_ptr());
    benchmark::DoNotOptimize(dw.data_ptr());
  });
}

void BM_RMSNorm_ATen(benchmark::State& state) {
  RMSNormInputs in;
  const torch::Tensor x = in.x.clone().requires_grad_(true);
  const torch::Tensor weight = in.weight.clone().requires_grad_(true);
  time_passes(state, in.bytes(), [&] {
    const torch::Tensor y = at::rms_norm(x, {kHidden}, weight, kEps).to(torch::kBFloat16);
    const auto grads = torch::autograd::grad({y}, {x, weight}, {in.grad});
    benchmark::DoNotOptimize(grads[0].data_ptr());
  });
}

// ---- Residual add + RMSNorm: forward reads the fp32 residual and the bf16 delta, writes the fp32
// sum and the bf16 y; backward reads dy (bf16), d sum (fp32) and the sum, writes d residual (fp32)
// and d delta (bf16). The ATen side is the add, then at::rms_norm, and autograd through both.

struct AddRMSNormInputs {
  torch::Tensor residual = randn_cuda({kTokens, kHidden}, torch::kFloat32);
  torch::Tensor delta = randn_cuda({kTokens, kHidden}, torch::kBFloat16);
  torch::Tensor weight = 1.0 + 0.1 * randn_cuda({kHidden}, torch::kFloat32);
  torch::Tensor grad_y = randn_cuda({kTokens, kHidden}, torch::kBFloat16);
  torch::Tensor grad_sum = randn_cuda({kTokens, kHidden}, torch::kFloat32);
  int64_t bytes() const { return residual.numel() * ((4 + 2 + 4 + 2) + (2 + 4 + 4 + 4 + 2)); }
};

void BM_AddRMSNorm_Kernel(benchmark::State& state) {
  AddRMSNormInputs in;
  time_passes(state, in.bytes(), [&] {
    const auto [sum, y, rstd] = loom::nn::cuda::add_rms_norm_forward(in.residual, in.delta, in.weight,
                                                                     kEps, torch::kBFloat16);
    const auto [dr, dd, dw] = loom::nn::cuda::add_rms_norm_backward(
        in.grad_y, in.grad_sum, sum, in.weight, rstd, torch::kBFloat16);
    benchmark::DoNotOptimize(y.data_ptr());
    benchmark::DoNotOptimize(dd.data_ptr());
    benchmark::DoNotOptimize(dw.data_ptr());
  });
}

void BM_AddRMSNorm_ATen(benchmark::State& state) {
  AddRMSNormInputs in;
  const torch::Tensor residual = in.residual.clone().requires_grad_(true);
  const torch::Tensor delta = in.delta.clone().requires_grad_(true);
  const torch::Tensor weight = in.weight.clone().requires_grad_(true);
  time_passes(state, in.bytes(), [&] {
    const torch::Tensor sum = residual + delta;
    const torch::Tensor y = at::rms_norm(sum, {kHidden}, weight, kEps).to(torch::kBFloat16);
    const auto grads =
        torch::autograd::grad({y, sum}, {residual, delta, weight}, {in.grad_y, in.grad_sum});
    benchmark::DoNotOptimize(grads[1].data_ptr());
  });
}

// ---- RoPE: forward reads q and writes the rotated q; backward (the inverse rotation) reads dq'
// and writes dq. The [2, 2048, 64] fp32 cache stays in L2: left out.

struct RoPEInputs {
  torch::Tensor q = randn_cuda({kBatch, kSeq, kHeads, kHeadDim}, torch::kBFloat16);
  torch::Tensor grad = randn_cuda({kBatch, kSeq, kHeads, kHeadDim}, torch::kBFloat16);
  torch::Tensor cache =
      loom::nn::rope_cache(loom::nn::rope_inverse_frequencies(kHeadDim, 5e5, std::nullopt), kSeq)
          .to(torch::kCUDA);
  int64_t bytes() const { return 4 * q.numel() * 2; }
};

void BM_RoPE_Kernel(benchmark::State& state) {
  RoPEInputs in;
  time_passes(state, in.bytes(), [&] {
    const at::Tensor y = loom::nn::cuda::rope_forward(in.q, in.cache, /*inverse=*/false);
    const at::Tensor dq = loom::nn::cuda::rope_forward(in.grad, in.cache, /*inverse=*/true);
    benchmark::DoNotOptimize(y.data_ptr());
    benchmark::DoNotOptimize(dq.data_ptr());
  });
}

// nn/fused.cpp's generic composition: the cache cast to x's dtype, a cat for the half swap.
void BM_RoPE_ATen(benchmark::State& state) {
  RoPEInputs in;
  const torch::Tensor q = in.q.clone().requires_grad_(true);
  const int64_t half = kHeadDim / 2;
  time_passes(state, in.bytes(), [&] {
    const torch::Tensor cos = in.cache.select(0, 0).narrow(0, 0, kSeq).unsqueeze(1).to(q.dtype());
    const torch::Tensor sin = in.cache.select(0, 1).narrow(0, 0, kSeq).unsqueeze(1).to(q.dtype());
    const torch::Tensor swapped = torch::cat({q.narrow(-1, half, half), q.narrow(-1, 0, half)}, -1);
    const torch::Tensor y = (q * cos).addcmul_(swapped, sin);
    const auto grads = torch::autograd::grad({y}, {q}, {in.grad});
    benchmark::DoNotOptimize(grads[0].data_ptr());
  });
}

// ---- AdamW: one update of a 1B model's FFN matrices' worth of float32 parameters (16 x 3 x 2048 x
// 8192 = 805M would not fit twice with its state on every card: 64M elements per tensor here, 4
// tensors), reading param, grad, exp_avg, exp_avg_sq and writing param and both moments: 28 bytes
// per element. Loom's kernel (optim/cuda) against at::_fused_adamw_ on the same lists.

struct AdamWInputs {
  std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  AdamWInputs() {
    for (int i = 0; i < 4; ++i) {
      params.push_back(randn_cuda({64 << 20}, torch::kFloat32));
      grads.push_back(randn_cuda({64 << 20}, torch::kFloat32));
      exp_avgs.push_back(torch::zeros_like(params.back()));
      exp_avg_sqs.push_back(torch::zeros_like(params.back()));
      steps.push_back(torch::ones({}, torch::TensorOptions(torch::kCUDA)));
    }
  }
  int64_t bytes() const { return 28 * 4 * (int64_t{64} << 20); }
};

void BM_AdamW_Kernel(benchmark::State& state) {
  AdamWInputs in;
  const at::Tensor none;
  time_passes(state, in.bytes(), [&] {
    for (size_t i = 0; i < in.params.size(); ++i) {
      loom::optim::cuda::adamw_update_(in.params[i], in.grads[i], in.exp_avgs[i], in.exp_avg_sqs[i], in.steps[i],
                                       1e-4, 0.9, 0.95, 0.1, 1e-8, none, none);
    }
  });
}

void BM_AdamW_ATenFused(benchmark::State& state) {
  AdamWInputs in;
  time_passes(state, in.bytes(), [&] {
    at::_fused_adamw_(in.params, in.grads, in.exp_avgs, in.exp_avg_sqs, {}, in.steps, 1e-4, 0.9, 0.95, 0.1, 1e-8,
                      false, false);
  });
}

BENCHMARK(BM_SwiGLU_Kernel)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SwiGLU_ATen)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RMSNorm_Kernel)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RMSNorm_ATen)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AddRMSNorm_Kernel)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AddRMSNorm_ATen)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RoPE_Kernel)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RoPE_ATen)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AdamW_Kernel)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AdamW_ATenFused)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::cout << "skipped: no CUDA device" << std::endl;
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
