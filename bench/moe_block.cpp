// One MoE block (moe::MoE: router, stable permutation, per-expert SwiGLU GEMMs, float32 weighting,
// deterministic combination) forward + backward on random tokens, for bench/moe_vs_pytorch.py,
// which runs transformers' Qwen3MoeSparseMoeBlock on the same shapes and weights' distribution.
// Prints one JSON line per rank: median seconds per forward+backward, tokens/s, the peak RSS
// growth over the timed steps (the same measure the Python side takes of itself) and, with expert
// parallelism, the all-to-all bytes this rank sent per step, measured and by the formula of
// docs/moe.md (ep::dispatch_wire_bytes).
//
// Usage: loom_bench_moe [--tokens 2048] [--dim 512] [--ffn 256] [--experts 16] [--top-k 4]
//                       [--steps 5] [--warmup 2] [--threads 2] [--ep 1]
// Under `loom launch --nproc N --exec --` every rank runs its own block on its own tokens; with
// --ep N the ranks split the experts and dispatch by all-to-all (EP), with --ep 1 each holds all
// of them (data parallel, no exchange).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "loom/core/memory.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/process_group.h"
#include "loom/ep/expert_parallel.h"
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
  const int warmup = arg(argc, argv, "--warmup", 2), ep_degree = arg(argc, argv, "--ep", 1);
  at::set_num_threads(arg(argc, argv, "--threads", 2));
  const auto env = loom::distributed::detect_launch_env();
  std::shared_ptr<loom::distributed::Distributed> dist;
  std::shared_ptr<loom::distributed::Comm> ep_comm;
  if (env.world_size > 1) {
    dist = loom::distributed::init_distributed(env, std::chrono::seconds(120));
    if (ep_degree > 1) {
      if (ep_degree != env.world_size) {
        std::fprintf(stderr, "error: --ep %d must be 1 or the number of ranks (%d)\n", ep_degree, env.world_size);
        return 2;
      }
      ep_comm = dist->world();
    }
  } else if (ep_degree > 1) {
    std::fprintf(stderr, "error: --ep %d needs %d ranks: run it under loom launch --nproc %d --exec --\n", ep_degree,
                 ep_degree, ep_degree);
    return 2;
  }
  torch::manual_seed(0);  // the same weights on every rank
  loom::moe::MoEOptions options;
  options.router = {.n_experts = experts, .top_k = top_k, .normalize = true};
  options.hidden_dim = ffn;
  loom::moe::MoE block(dim, options, torch::TensorOptions());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : block.named_parameters()) p.slot->tensor.normal_(0, 0.02);
  }
  if (ep_comm) loom::ep::ExpertParallel(ep_comm).apply(block, "moe");
  torch::manual_seed(1 + env.rank);  // each rank its own tokens
  const torch::Tensor x = torch::randn({tokens, dim});
  std::vector<double> times;
  double sent_bytes = 0, formula_bytes = 0;
  const int64_t baseline = loom::memory::current_rss_bytes();
  for (int i = 0; i < warmup + steps; ++i) {
    if (i == warmup) loom::memory::reset_peak_rss();
    for (auto& p : block.named_parameters()) p.slot->tensor.mutable_grad() = torch::Tensor();
    block.reset_state();
    const torch::Tensor input = x.detach().requires_grad_(true);
    const loom::distributed::CommSnapshot before = loom::distributed::comm_stats().snapshot();
    const auto start = std::chrono::steady_clock::now();
    block.forward(input).sum().backward();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i < warmup) continue;
    times.push_back(s);
    if (!ep_comm) continue;
    const auto after = loom::distributed::comm_stats().snapshot();
    const auto op = loom::distributed::CommOp::kAllToAll;
    sent_bytes += after.get(op, ep_comm->name()).wire_bytes.value() - before.get(op, ep_comm->name()).wire_bytes.value();
    // The formula from every rank's counts of this step (gathered outside the timed region).
    torch::Tensor all = torch::empty({ep_comm->size() * experts});
    ep_comm->all_gather_into_tensor(all, block.tokens_per_expert().contiguous());
    std::vector<std::vector<int64_t>> counts(ep_comm->size(), std::vector<int64_t>(experts));
    for (int r = 0; r < ep_comm->size(); ++r) {
      for (int e = 0; e < experts; ++e) counts[r][e] = static_cast<int64_t>(all[r * experts + e].item<float>());
    }
    formula_bytes += static_cast<double>(loom::ep::dispatch_wire_bytes(counts, ep_comm->rank(), dim, 4));
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  std::printf("{\"rank\": %d, \"seconds\": %.6f, \"tokens_per_s\": %.1f, \"peak_rss_growth_mib\": %.1f, "
              "\"all_to_all_bytes_per_step\": %.0f, \"formula_bytes_per_step\": %.0f}\n",
              env.rank, median, tokens / median,
              static_cast<double>(std::max<int64_t>(0, loom::memory::peak_rss_bytes() - baseline)) / (1 << 20),
              sent_bytes / steps, formula_bytes / steps);
  std::fflush(stdout);
  if (dist) dist->shutdown();
  return 0;
}
