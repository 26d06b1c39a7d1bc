// Where one Loom training step's time goes: the bench model (llama3 "124M", seq 256, batch 4,
// fp32, AdamW, clipping — what `loom train --config bench/llama3_124m.toml` runs per step),
// profiled with the libtorch (Kineto) CPU profiler. Prints per-op self time per step, largest
// first, plus the phase totals; bench/profile_eager.py prints the same table for PyTorch eager.
//
// Usage: loom_step_profile [--steps 3] [--warmup 2] [--threads 2]
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "loom/models/llama3/model.h"
#include "loom/models/llama3/model_args.h"
#include "loom/optim/adamw.h"
#include "loom/optim/clip_grad.h"
#include "loom/optim/optimizer.h"

namespace {

int arg(int argc, char** argv, const std::string& name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == name) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

struct Interval {
  std::string name;
  uint64_t start, end;
};

}  // namespace

int main(int argc, char** argv) {
  const int steps = arg(argc, argv, "--steps", 3);
  const int warmup = arg(argc, argv, "--warmup", 2);
  at::set_num_threads(arg(argc, argv, "--threads", 2));
  const int64_t batch = 4, seq = 256;

  torch::manual_seed(0);
  loom::llama3::Transformer model(loom::llama3::flavor("124M", 32000));
  model.init_weights(0);
  loom::optim::NamedTensors named;
  std::vector<torch::Tensor> params;
  for (const auto& p : model.named_parameters()) {
    named.emplace_back(p.name, p.slot->tensor);
    params.push_back(p.slot->tensor);
  }
  loom::optim::AdamWOptions options;
  options.lr = 3e-4;
  loom::optim::AdamW optimizer(loom::optim::weight_decay_param_groups(named, 0.1), options);

  auto step = [&] {
    const torch::Tensor row = torch::randint(0, 32000, {batch, seq + 1}, torch::kInt64);
    optimizer.zero_grad(true);
    torch::Tensor loss;
    {
      RECORD_USER_SCOPE("## forward + loss");
      loss = model.forward_loss(row.narrow(1, 0, seq), row.narrow(1, 1, seq).contiguous());
    }
    {
      RECORD_USER_SCOPE("## backward");
      loss.backward();
    }
    {
      RECORD_USER_SCOPE("## clip");
      std::vector<torch::Tensor> grads;
      for (const auto& p : params) grads.push_back(p.grad());
      loom::optim::clip_grad_norm_(grads, 1.0);
    }
    {
      RECORD_USER_SCOPE("## optimizer");
      optimizer.step();
    }
  };
  for (int i = 0; i < warmup; ++i) step();

  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  const std::set<ActivityType> activities{ActivityType::CPU};
  torch::autograd::profiler::prepareProfiler(ProfilerConfig(ProfilerState::KINETO), activities);
  torch::autograd::profiler::enableProfiler(ProfilerConfig(ProfilerState::KINETO), activities);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto result = torch::autograd::profiler::disableProfiler();

  // Self time = duration minus directly nested events, per recording thread.
  std::map<uint64_t, std::vector<Interval>> by_thread;
  for (const auto& e : result->events()) {
    by_thread[e.startThreadId()].push_back({e.name(), e.startNs(), e.endNs()});
  }
  std::map<std::string, std::pair<double, int64_t>> self_ms;  // name -> (ms, calls)
  std::map<std::string, double> phases;
  for (auto& [tid, events] : by_thread) {
    std::sort(events.begin(), events.end(), [](const Interval& a, const Interval& b) {
      return a.start != b.start ? a.start < b.start : a.end > b.end;
    });
    std::vector<std::pair<const Interval*, double>> stack;  // (event, child time)
    auto close = [&](const Interval* e, double child) {
      const double dur = static_cast<double>(e->end - e->start) / 1e6;
      auto& slot = self_ms[e->name];
      slot.first += dur - child;
      slot.second += 1;
      if (e->name.rfind("## ", 0) == 0) phases[e->name] += dur;
      return dur;
    };
    for (const auto& e : events) {
      while (!stack.empty() && stack.back().first->end <= e.start) {
        const double dur = close(stack.back().first, stack.back().second);
        stack.pop_back();
        if (!stack.empty()) stack.back().second += dur;
      }
      stack.push_back({&e, 0.0});
    }
    while (!stack.empty()) {
      const double dur = close(stack.back().first, stack.back().second);
      stack.pop_back();
      if (!stack.empty()) stack.back().second += dur;
    }
  }
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> rows(self_ms.begin(), self_ms.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  std::printf("Loom step profile: llama3 124M, batch %lld x seq %lld, %d threads, %d steps, "
              "%.3f s/step wall (profiled)\n",
              static_cast<long long>(batch), static_cast<long long>(seq), at::get_num_threads(),
              steps, wall / steps);
  for (const auto& [name, ms] : phases) std::printf("  %-22s %9.1f ms/step\n", name.c_str(), ms / steps);
  std::printf("%-60s %12s %8s\n", "op (self time)", "ms/step", "calls");
  for (const auto& [name, v] : rows) {
    if (v.first / steps < 1.0 || name.rfind("## ", 0) == 0) continue;
    std::printf("%-60s %12.1f %8lld\n", name.substr(0, 60).c_str(), v.first / steps,
                static_cast<long long>(v.second / steps));
  }
  return 0;
}
