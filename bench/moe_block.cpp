// One MoE block (moe::MoE: router, stable permutation, per-expert SwiGLU GEMMs, float32 weighting,
// deterministic combination) forward + backward on random tokens, for bench/moe_vs_pytorch.py,
// which runs transformers' Qwen3MoeSparseMoeBlock on the same shapes and weights' distribution.
// Prints one JSON line: median seconds per forward+backward, tokens/s, and the peak RSS growth over
// the timed steps (the same measure the Python side takes of itself).
//
// Usage: loom_bench_moe [--tokens 2048] [--dim 512] [--ffn 256] [--experts 16] [--top-k 4]
//                       [--steps 5] [--warmup 2] [--threads 2]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "loom/core/memory.h"
#include "loom/moe/moe.h"

namespace {

int arg(int argc, char** argv, const std::string& name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == name) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int tokens = arg(argc, argv, "--tokens", 2048), dim = arg(argc, argv, "--dim", 512);
  const int ffn = arg(argc, argv, "--ffn", 256), experts = arg(argc, argv, "--experts", 16);
  const int top_k = arg(argc, argv, "--top-k", 4), steps = arg(argc, argv, "--steps", 5);
  const int warmup = arg(argc, argv, "--warmup", 2);
  at::set_num_threads(arg(argc, argv, "--threads", 2));
  torch::manual_seed(0);
  loom::moe::MoEOptions options;
  options.router = {.n_experts = experts, .top_k = top_k, .normalize = true};
  options.hidden_dim = ffn;
  loom::moe::MoE block(dim, options, torch::TensorOptions());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : block.named_parameters()) p.slot->tensor.normal_(0, 0.02);
  }
  const torch::Tensor x = torch::randn({tokens, dim});
  std::vector<double> times;
  const int64_t baseline = loom::memory::current_rss_bytes();
  for (int i = 0; i < warmup + steps; ++i) {
    if (i == warmup) loom::memory::reset_peak_rss();
    for (auto& p : block.named_parameters()) p.slot->tensor.mutable_grad() = torch::Tensor();
    const torch::Tensor input = x.detach().requires_grad_(true);
    const auto start = std::chrono::steady_clock::now();
    block.forward(input).sum().backward();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i >= warmup) times.push_back(s);
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  std::printf("{\"seconds\": %.6f, \"tokens_per_s\": %.1f, \"peak_rss_growth_mib\": %.1f}\n", median,
              tokens / median,
              static_cast<double>(std::max<int64_t>(0, loom::memory::peak_rss_bytes() - baseline)) / (1 << 20));
  return 0;
}
