// Activation memory and compute time of activation checkpointing, counted exactly: the bench model
// (llama3 "124M": dim 768, 12 layers, 12 heads / 4 kv, FFN 2048, vocab 32000, fp32) at seq 1024,
// forward_loss + backward with each AC mode applied as `loom train` applies it (models::apply_ac).
// c10's allocator is watched by memory::AllocationTracker, so the figures are the tensors' bytes,
// not RSS (which malloc's caching and the process's other memory blur; bench/ac_memory.py gives
// the end-to-end RSS and step time of `loom train`):
//   kept   bytes allocated by the forward and still alive when backward starts (the saved
//          activations; the loss itself is a scalar);
//   peak   the largest figure from the start of the forward to the end of the backward (saved
//          activations + the gradients being produced + the recompute's temporaries);
//   time   median forward + backward seconds.
//
// Usage: loom_bench_ac [--steps 3] [--warmup 1] [--threads 2] [--batch 2] [--seq 1024]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "loom/ac/activation_checkpoint.h"
#include "loom/core/memory.h"
#include "loom/models/llama3/model.h"
#include "loom/models/llama3/model_args.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/spec.h"

namespace {

int arg(int argc, char** argv, const std::string& name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == name) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

struct Figures {
  double kept_gib = 0, peak_gib = 0, step_s = 0;
  double loss = 0;
};

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

Figures measure(const loom::ac::ACOptions& options, int64_t batch, int64_t seq, int warmup, int steps) {
  torch::manual_seed(0);
  loom::llama3::ModelArgs args = loom::llama3::flavor("124M", 32000);
  args.max_seq_len = std::max(args.max_seq_len, seq);
  loom::llama3::Transformer model(args);
  model.init_weights(0);
  loom::models::apply_ac(model, options);
  const torch::Tensor row = torch::randint(0, 32000, {batch, seq + 1}, torch::kInt64);
  const torch::Tensor tokens = row.narrow(1, 0, seq), labels = row.narrow(1, 1, seq).contiguous();
  Figures f;
  std::vector<double> times;
  for (int i = 0; i < warmup + steps; ++i) {
    model.zero_grad(true);
    loom::memory::AllocationTracker tracker;
    const auto start = std::chrono::steady_clock::now();
    torch::Tensor loss = model.forward_loss(tokens, labels);
    const int64_t kept = tracker.current_bytes();
    loss.backward();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i < warmup) continue;
    times.push_back(s);
    f.kept_gib = kept / kGiB;
    f.peak_gib = tracker.peak_bytes() / kGiB;
    f.loss = loss.item<double>();
  }
  std::sort(times.begin(), times.end());
  f.step_s = times[times.size() / 2];
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = arg(argc, argv, "--steps", 3);
  const int warmup = arg(argc, argv, "--warmup", 1);
  const int64_t batch = arg(argc, argv, "--batch", 2), seq = arg(argc, argv, "--seq", 1024);
  at::set_num_threads(arg(argc, argv, "--threads", 2));
  const std::vector<std::pair<std::string, loom::ac::ACOptions>> modes = {
      {"none", {}},
      {"selective op", loom::ac::ACOptions::from({loom::ac::Mode::kSelective, "op"})},
      {"selective 2", loom::ac::ACOptions::from({loom::ac::Mode::kSelective, "2"})},
      {"full", loom::ac::ACOptions::from({loom::ac::Mode::kFull, ""})},
  };
  std::printf("124M, batch %lld x seq %lld, %d threads, forward_loss + backward, median of %d (after %d warm-up)\n",
              static_cast<long long>(batch), static_cast<long long>(seq), at::get_num_threads(), steps, warmup);
  std::printf("%-13s %10s %8s %10s %8s %8s %8s  %s\n", "mode", "kept GiB", "vs none", "peak GiB", "vs none",
              "step s", "vs none", "loss");
  Figures base;
  for (const auto& [name, options] : modes) {
    const Figures f = measure(options, batch, seq, warmup, steps);
    if (name == "none") base = f;
    std::printf("%-13s %10.3f %8.3f %10.3f %8.3f %8.2f %8.3f  %.6f\n", name.c_str(), f.kept_gib,
                f.kept_gib / base.kept_gib, f.peak_gib, f.peak_gib / base.peak_gib, f.step_s,
                f.step_s / base.step_s, f.loss);
    std::fflush(stdout);
  }
  return 0;
}
