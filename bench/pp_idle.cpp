// Pipeline idle time measured on the executor next to the simulator's prediction (issue 11):
//   build/bin/loom launch --nproc 4 --exec -- build/bin/loom_bench_pp_idle [--steps 5] [--microbatches 8]
//       [--seq 256] [--layers 8] [--schedules 1F1B,Interleaved1F1B,ZBVZeroBubble]
// Every rank builds its stages of the debug-model shape (dim 256, 16 heads, vocab 2048) with
// `--layers` layers, and runs each schedule over `--microbatches` micro-batches of one row for 2
// warm-up and `--steps` timed steps (SGD-free: forward and backward only, gradients zeroed). Per
// rank it measures the step's compute (F, B, I, W) and its idle time (step - compute: waiting for
// activations and gradients, and for sends at the end). The simulator then runs the same schedule
// with the measured mean cost of each action kind (averaged over ranks and steps, transfers free)
// and predicts each rank's idle time; rank 0 prints both and their ratio.
//
// The simulator gives every stage the same cost per kind; the real first stage also embeds and
// the last computes the output head and loss, so the ranks' true costs differ: that, and ranks
// sharing CPU cores (4 ranks on a 2-core machine compete whenever more than 2 compute at once), is
// what the ratio measures.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/process_group.h"
#include "loom/models/common/pipeline.h"
#include "loom/models/llama3/model.h"
#include "loom/pipeline/executor.h"
#include "loom/pipeline/generators.h"
#include "loom/pipeline/simulator.h"

namespace {
using namespace loom;

struct Options {
  int steps = 5;
  int microbatches = 8;
  int64_t seq = 256;
  int64_t layers = 8;
  std::vector<std::string> schedules = {"1F1B", "Interleaved1F1B", "ZBVZeroBubble"};
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--steps") o.steps = std::stoi(value);
    else if (key == "--microbatches") o.microbatches = std::stoi(value);
    else if (key == "--seq") o.seq = std::stoll(value);
    else if (key == "--layers") o.layers = std::stoll(value);
    else if (key == "--schedules") {
      o.schedules.clear();
      std::stringstream ss(value);
      for (std::string s; std::getline(ss, s, ',');) o.schedules.push_back(s);
    } else {
      fail_usage("unknown option ", key, "; options: --steps --microbatches --seq --layers --schedules");
    }
  }
  return o;
}

std::vector<double> gather(distributed::Comm& comm, double value) {
  torch::Tensor all = torch::zeros({comm.size()}, torch::kFloat64);
  all[comm.rank()] = value;
  comm.all_reduce(all);
  return std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + comm.size());
}

void run_schedule(const std::shared_ptr<distributed::Comm>& comm, const Options& o, const std::string& name) {
  const int pp = comm->size();
  llama3::ModelArgs args = llama3::flavor("debugmodel", 2048);
  args.n_layers = o.layers;
  args.max_seq_len = std::max(args.max_seq_len, o.seq);
  models::PipelineOptions popt;
  popt.schedule = name;
  popt.microbatch_size = 1;
  popt.microbatches = o.microbatches;
  popt.seq_len = o.seq;
  const models::PipelinePlan plan = models::plan_pipeline(args, pp, popt);
  const std::vector<int> ids = plan.schedule.stages_of(comm->rank());
  auto models = models::split_into_stages(
      [&] { return std::make_shared<llama3::Transformer>(args, torch::TensorOptions().device(torch::kMeta)); },
      plan.layer_bounds, ids);
  for (auto& m : models) {
    m->to_empty(torch::kCPU);
    m->init_weights(0);
  }
  auto stages = models::make_pipeline_stages(models, ids, plan.schedule.num_stages());
  pipeline::PipelineExecutor executor(plan.schedule, stages, {comm, {1, o.seq, args.dim}});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  std::vector<torch::Tensor> tokens, labels;
  for (int i = 0; i < o.microbatches; ++i) {
    tokens.push_back(torch::randint(0, args.vocab_size, {1, o.seq}, gen));
    labels.push_back(torch::randint(0, args.vocab_size, {1, o.seq}, gen));
  }
  double total = 0, compute = 0;
  std::array<double, 4> kind_seconds{};
  std::array<double, 4> kind_count{};
  for (int step = 0; step < 2 + o.steps; ++step) {
    for (auto& m : models) m->zero_grad();
    comm->barrier();  // every rank starts the step together
    executor.step(tokens, labels);
    if (step < 2) continue;
    const pipeline::StepTimes& t = executor.last_step_times();
    total += t.total / o.steps;
    compute += t.compute / o.steps;
    for (size_t k = 0; k < 4; ++k) kind_seconds[k] += t.kind_seconds[k], kind_count[k] += t.kind_count[k];
  }
  // Mean cost of each kind over every rank's actions.
  torch::Tensor kinds = torch::zeros({8}, torch::kFloat64);
  for (size_t k = 0; k < 4; ++k) kinds[k] = kind_seconds[k], kinds[4 + k] = kind_count[k];
  comm->all_reduce(kinds);
  auto mean = [&](size_t k) { return kinds[4 + k].item<double>() > 0 ? kinds[k].item<double>() / kinds[4 + k].item<double>() : 0.0; };
  pipeline::SimulationOptions sim;
  sim.costs.forward = mean(0);
  sim.costs.backward = mean(1);
  sim.costs.backward_input = mean(2);
  sim.costs.backward_weight = mean(3);
  const pipeline::SimulationResult predicted = pipeline::simulate(plan.schedule, sim);
  const std::vector<double> totals = gather(*comm, total), computes = gather(*comm, compute);
  if (comm->rank() != 0) return;
  std::printf("%s: pp %d, %d stages (%d per rank), %d micro-batches of 1 x %lld tokens; measured mean costs "
              "F %.1f ms, B %.1f ms, I %.1f ms, W %.1f ms\n",
              plan.schedule.name.c_str(), pp, plan.schedule.num_stages(), plan.schedule.stages_per_rank,
              o.microbatches, static_cast<long long>(o.seq), 1e3 * mean(0), 1e3 * mean(1), 1e3 * mean(2), 1e3 * mean(3));
  double measured_idle = 0, predicted_idle = 0, measured_span = 0;
  for (int r = 0; r < pp; ++r) {
    const double idle = totals[r] - computes[r];
    const double want = predicted.idle_time[static_cast<size_t>(r)];
    measured_idle += idle, predicted_idle += want, measured_span = std::max(measured_span, totals[r]);
    std::printf("  rank %d: step %.3f s, compute %.3f s, idle %.3f s | simulator: idle %.3f s | measured / predicted idle %.2f\n",
                r, totals[r], computes[r], idle, want, want > 0 ? idle / want : 0.0);
  }
  std::printf("  all ranks: idle %.3f s vs predicted %.3f s (ratio %.2f); step %.3f s vs predicted makespan %.3f s "
              "(ratio %.2f); bubble fraction measured %.3f, simulator %.3f\n",
              measured_idle, predicted_idle, predicted_idle > 0 ? measured_idle / predicted_idle : 0.0, measured_span,
              predicted.makespan, measured_span / predicted.makespan, measured_idle / (pp * measured_span),
              predicted.bubble_fraction);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int rank = -1;
  try {
    const Options options = parse(argc, argv);
    const auto env = distributed::detect_launch_env();
    rank = env.rank;
    torch::set_num_threads(1);
    auto d = distributed::init_distributed(env, std::chrono::seconds(300));
    for (const std::string& name : options.schedules) run_schedule(d->world(), options, name);
    d->shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what());
  }
  return 1;
}
