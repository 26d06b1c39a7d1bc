// Per-rank scenarios of the pipeline executor tests, started as
//   loom launch --nproc N --exec -- loom_pp_worker parity
// Every rank builds the single-process Llama (the reference) from the seed and, for each schedule,
// its own pipeline stages (models/common/pipeline.h) from the same seed; the reference runs the whole
// global batch, the ranks run the schedule over its micro-batches (PipelineExecutor). The step
// loss and every parameter gradient a rank owns must equal the reference's; then three SGD steps
// on both, comparing again after each. Rank 0 prints one line per configuration with the worst
// differences over all ranks and steps. Exits 1 with one line naming the configuration and
// mismatch.
#include <cstdio>
#include <string>

#include "loom/core/error.h"
#include "loom/models/common/pipeline.h"
#include "loom/models/llama3/model.h"
#include "loom/pipeline/executor.h"
#include "loom/pipeline/generators.h"
#include "loom/testing/worker.h"

namespace {

using namespace loom;

llama3::ModelArgs tiny_args() {
  llama3::ModelArgs a;
  a.dim = 64, a.n_layers = 8, a.n_heads = 8, a.n_kv_heads = 4, a.vocab_size = 96;
  a.multiple_of = 32, a.max_seq_len = 16, a.rope_theta = 10000.0;
  return a;  // ffn hidden 192
}

constexpr uint64_t kSeed = 7;
constexpr int64_t kBatch = 8;
constexpr int64_t kSeq = 16;
constexpr double kLr = 0.05;
constexpr int kSteps = 4;  // the first step, then three more after SGD updates

struct Config {
  std::string schedule;
  int microbatches;
  int stages_per_rank;  // 0: the schedule's default
  pipeline::WeightGradMethod method = pipeline::WeightGradMethod::kPerOp;
  std::vector<std::string> split_points = {};
};

double max_relative_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a - b).abs().max().item<double>() / scale;
}

double all_max(distributed::Comm& comm, double value) {
  torch::Tensor t = torch::tensor({value}, torch::kFloat64);
  comm.all_reduce(t, distributed::ReduceOp::kMax);
  return t.item<double>();
}

void check_configuration(const std::shared_ptr<distributed::Comm>& comm, const Config& c) {
  const int pp = comm->size();
  const llama3::ModelArgs args = tiny_args();
  const pipeline::Schedule schedule =
      pipeline::build_schedule({c.schedule, pp, c.microbatches, c.stages_per_rank});
  const int v = schedule.stages_per_rank;
  const std::string config = c10::str(
      "pp=", pp, " ", schedule.name, " m=", c.microbatches, " v=", v,
      c.method == pipeline::WeightGradMethod::kPerOp ? "" : " W=autograd",
      c.split_points.empty() ? "" : " split_points");

  llama3::Transformer reference(args);
  reference.init_weights(kSeed);

  const std::vector<int64_t> bounds =
      models::stage_layer_bounds(args, {pp, v, 0, c.split_points});
  const std::vector<int> stage_ids = schedule.stages_of(comm->rank());
  auto models = models::split_into_stages(
      [&] { return std::make_shared<llama3::Transformer>(args, torch::TensorOptions().device(torch::kMeta)); },
      bounds, stage_ids);
  for (auto& m : models) {
    m->to_empty(torch::kCPU);
    m->init_weights(kSeed);
  }
  auto stages = models::make_pipeline_stages(models, stage_ids, schedule.num_stages(), c.method);
  const int64_t mb_size = kBatch / c.microbatches;
  pipeline::PipelineExecutor executor(schedule, stages, {comm, {mb_size, kSeq, args.dim}});

  // Every parameter of the model lives on exactly one rank, under its global name.
  int64_t owned = 0;
  for (auto& m : models) {
    for (const auto& p : m->named_parameters()) {
      LOOM_REQUIRE(torch::equal(p.tensor(), reference.parameter(p.name)), config, ": initial ",
                   p.name, " differs from the reference");
      ++owned;
    }
  }
  torch::Tensor total = torch::tensor({owned}, torch::kInt64);
  comm->all_reduce(total);
  LOOM_REQUIRE(total.item<int64_t>() == static_cast<int64_t>(reference.named_parameters().size()),
               config, ": the stages hold ", total.item<int64_t>(), " parameters, the model ",
               reference.named_parameters().size());

  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const torch::Tensor tokens = torch::randint(0, args.vocab_size, {kBatch, kSeq}, gen);
  const torch::Tensor labels = torch::randint(0, args.vocab_size, {kBatch, kSeq}, gen);
  std::vector<torch::Tensor> inputs, targets;
  for (int i = 0; i < c.microbatches; ++i) {
    inputs.push_back(tokens.narrow(0, i * mb_size, mb_size));
    targets.push_back(labels.narrow(0, i * mb_size, mb_size));
  }

  double worst_loss = 0, worst_grad = 0;
  std::string worst_name;
  double first_loss = 0, last_loss = 0;
  for (int step = 0; step < kSteps; ++step) {
    reference.zero_grad();
    for (auto& m : models) m->zero_grad();
    const torch::Tensor ref_loss = reference.forward_loss(tokens, labels);
    ref_loss.backward();
    const double loss = executor.step(inputs, targets);
    const double loss_diff = std::abs(loss - ref_loss.item<double>()) / ref_loss.item<double>();
    LOOM_REQUIRE(loss_diff <= 1e-6, config, " step ", step, ": loss ", loss, " vs reference ",
                 ref_loss.item<double>());
    worst_loss = std::max(worst_loss, loss_diff);
    if (step == 0) first_loss = loss;
    last_loss = loss;
    for (auto& m : models) {
      for (const auto& p : m->named_parameters()) {
        const torch::Tensor& g = p.tensor().grad();
        LOOM_REQUIRE(g.defined(), config, " step ", step, ": no gradient for ", p.name);
        const double d = max_relative_diff(g, reference.parameter(p.name).grad());
        LOOM_REQUIRE(d <= 1e-5, config, " step ", step, ": gradient of ", p.name, " differs by ", d,
                     " (relative to its largest element)");
        if (d > worst_grad) worst_grad = d, worst_name = p.name;
      }
    }
    torch::NoGradGuard no_grad;
    for (auto& m : models) {
      for (const auto& p : m->named_parameters()) p.slot->tensor.sub_(p.tensor().grad(), kLr);
    }
    for (const auto& p : reference.named_parameters()) p.slot->tensor.sub_(p.tensor().grad(), kLr);
  }
  worst_loss = all_max(*comm, worst_loss);
  const double worst_grad_all = all_max(*comm, worst_grad);
  if (comm->rank() == 0) {
    std::printf("%-58s loss %.6f -> %.6f over %d steps: loss diff %.1e, worst gradient diff %.1e\n",
                config.c_str(), first_loss, last_loss, kSteps, worst_loss, worst_grad_all);
    std::fflush(stdout);
  }
}

void scenario_parity(const std::shared_ptr<distributed::Comm>& comm) {
  using pipeline::WeightGradMethod;
  const int pp = comm->size();
  std::vector<Config> configs;
  const std::vector<int> ms = pp == 2 ? std::vector<int>{4, 8} : std::vector<int>{8};
  for (int m : ms) {
    for (const std::string& name : pipeline::schedule_names()) configs.push_back({name, m, 0});
  }
  // The plain autograd I/W split, and an uneven split from explicit split points.
  configs.push_back({"InterleavedZeroBubble", 8, 0, WeightGradMethod::kAutograd});
  configs.push_back({"ZBVZeroBubble", 8, 0, WeightGradMethod::kAutograd});
  configs.push_back({"DualPipeV", 8, 0, WeightGradMethod::kAutograd});
  if (pp == 2) {
    configs.push_back({"1F1B", 4, 0, WeightGradMethod::kPerOp, {"layers.3"}});
    configs.push_back({"ZBVZeroBubble", 4, 0, WeightGradMethod::kPerOp, {"layers.1", "layers.2", "layers.6"}});
  } else {
    configs.push_back({"1F1B", 8, 0, WeightGradMethod::kPerOp, {"layers.1", "layers.2", "5"}});
  }
  for (const Config& c : configs) check_configuration(comm, c);
}

}  // namespace

int main(int argc, char** argv) {
  return loom::testing::worker_main(argc, argv, {{"parity", scenario_parity}});
}
