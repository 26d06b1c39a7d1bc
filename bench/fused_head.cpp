// Output head + cross-entropy, forward and backward, three ways on the CPU: the hand-written fp32
// kernel (what CPU fp32 training runs), the device-generic chunked ATen path (what CUDA, bf16 and
// autocast run; forced here), and the at::linear + cross_entropy composition that materialises
// the [tokens, vocab] logits. Same sizes for all three, so the ratios are the point; on this
// 2-core machine absolute times move with the load.
//   build/bin/loom_bench_fused_head --benchmark_min_time=2
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "loom/nn/fused.h"

namespace {
using loom::nn::FusedImpl;

constexpr int64_t kTokens = 1024, kDim = 256, kVocab = 8192, kChunk = 512;

struct Inputs {
  torch::Tensor hidden, weight, labels;
  explicit Inputs(c10::ScalarType dtype) {
    torch::manual_seed(0);
    hidden = torch::randn({kTokens, kDim}).to(dtype).requires_grad_(true);
    weight = (torch::randn({kVocab, kDim}) * 0.05).to(dtype).requires_grad_(true);
    labels = torch::randint(0, kVocab, {kTokens}, torch::kInt64);
  }
};

template <typename F>
void run(benchmark::State& state, c10::ScalarType dtype, F loss_fn) {
  Inputs in(dtype);
  for (auto _ : state) {
    in.hidden.mutable_grad() = torch::Tensor();
    in.weight.mutable_grad() = torch::Tensor();
    loss_fn(in).backward();
    benchmark::DoNotOptimize(in.weight.grad().data_ptr());
  }
  // forward GEMM + two gradient GEMMs
  state.counters["GFLOP/s"] = benchmark::Counter(
      6.0 * kTokens * kDim * kVocab * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}

void BM_CpuKernelFp32(benchmark::State& state) {
  run(state, torch::kFloat32, [](Inputs& in) {
    return loom::nn::fused_linear_cross_entropy(in.hidden, in.weight, in.labels, -100, kChunk,
                                                FusedImpl::kCpuFp32);
  });
}

void BM_GenericFp32(benchmark::State& state) {
  run(state, torch::kFloat32, [](Inputs& in) {
    return loom::nn::fused_linear_cross_entropy(in.hidden, in.weight, in.labels, -100, kChunk,
                                                FusedImpl::kGeneric);
  });
}

void BM_CompositionFp32(benchmark::State& state) {
  run(state, torch::kFloat32, [](Inputs& in) {
    return torch::nn::functional::cross_entropy(at::linear(in.hidden, in.weight), in.labels);
  });
}

BENCHMARK(BM_CpuKernelFp32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_GenericFp32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CompositionFp32)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
