// Splitting Llama 3 into pipeline stages (models/common/pipeline.h) and running them in one process: the
// layer bounds and their errors, the parts each stage keeps (global parameter names), the chain of
// forward_part equal to forward_loss, and the executor on one rank with several stages (every
// action local) against the whole model, for B and for both I/W methods. The multi-rank parity of
// every schedule is pipeline/tests/test_executor.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <set>

#include "loom/core/error.h"
#include "loom/models/common/pipeline.h"
#include "loom/models/llama3/model.h"
#include "loom/pipeline/executor.h"
#include "loom/pipeline/generators.h"
#include "loom/testing/errors.h"

namespace {
using namespace loom;
using llama3::ModelArgs;
using models::PipelineSplit;
using llama3::Transformer;

ModelArgs split_test_args(int64_t layers = 8) {
  ModelArgs a;
  a.dim = 64, a.n_layers = layers, a.n_heads = 8, a.n_kv_heads = 4, a.vocab_size = 96;
  a.multiple_of = 32, a.max_seq_len = 16, a.rope_theta = 10000.0;
  return a;
}

std::vector<std::shared_ptr<models::Decoder>> stage_models(const ModelArgs& args,
                                                       const std::vector<int64_t>& bounds,
                                                       const std::vector<int>& ids) {
  auto models = models::split_into_stages(
      [&] { return std::make_shared<Transformer>(args, torch::TensorOptions().device(torch::kMeta)); },
      bounds, ids);
  for (auto& m : models) {
    m->to_empty(torch::kCPU);
    m->init_weights(7);
  }
  return models;
}

void expect_usage(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  loom::testing::expect_error<UsageError>(fn, parts);
}

}  // namespace

TEST(PipelineSplit, LayerBounds) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(models::stage_layer_bounds(split_test_args(), {2, 2}), (V{0, 2, 4, 6, 8}));
  EXPECT_EQ(models::stage_layer_bounds(split_test_args(10), {4, 1}), (V{0, 3, 6, 8, 10}));  // extras first
  EXPECT_EQ(models::stage_layer_bounds(split_test_args(), {2, 1, 4}), (V{0, 4, 8}));
  EXPECT_EQ(models::stage_layer_bounds(split_test_args(), {2, 2, 0, {"layers.1", "2", "layers.6"}}),
            (V{0, 1, 2, 6, 8}));
}

TEST(PipelineSplit, SplitsThatCannotBeMadeAreOneLineUsageErrors) {
  expect_usage([] { models::stage_layer_bounds(split_test_args(), {2, 2, 3}); },
               {"parallelism.pipeline_parallel_layers_per_stage = 3 does not split the model's 8 "
                "layers into 4 stages (pipeline_parallel_degree 2 x 2 stages per rank); valid: 2"});
  expect_usage([] { models::stage_layer_bounds(split_test_args(), {2, 1, 2}); },
               {"valid: 4 (2 layers per stage needs 2 stages per rank)"});
  expect_usage([] { models::stage_layer_bounds(split_test_args(10), {4, 1, 2}); },
               {"no value splits it: the layer count must be a multiple of 4"});
  expect_usage([] { models::stage_layer_bounds(split_test_args(4), {4, 2}); },
               {"cannot split the model's 4 layers into 8 stages", "use at most 4 stages"});
  expect_usage([] { models::stage_layer_bounds(split_test_args(), {2, 1, 0, {"layers.2", "layers.4"}}); },
               {"pipeline_parallel_split_points has 2 points; 2 stages", "need 1"});
  expect_usage([] { models::stage_layer_bounds(split_test_args(), {2, 2, 0, {"layers.4", "layers.2", "layers.6"}}); },
               {"'layers.2' must come after the previous point (layer 4)"});
  expect_usage([] { models::stage_layer_bounds(split_test_args(), {2, 1, 0, {"layer4"}}); },
               {"'layer4' is not a layer"});
  expect_usage([] { models::stage_layer_bounds(split_test_args(), {2, 1, 4, {"layers.4"}}); }, {"not both"});
}

TEST(PipelineSplit, StagesKeepTheirPartsUnderGlobalNames) {
  const ModelArgs args = split_test_args();
  const auto bounds = models::stage_layer_bounds(args, {2, 2});
  auto models = models::split_into_stages(
      [&] { return std::make_shared<Transformer>(args, torch::TensorOptions().device(torch::kMeta)); },
      bounds, {0, 1, 2, 3});
  std::set<std::string> names;
  for (auto& m : models) {
    for (const auto& p : m->named_parameters()) EXPECT_TRUE(names.insert(p.name).second) << p.name;
  }
  Transformer whole(args, torch::TensorOptions().device(torch::kMeta));
  std::set<std::string> expected;
  for (const auto& p : whole.named_parameters()) expected.insert(p.name);
  EXPECT_EQ(names, expected);
  EXPECT_TRUE(models[0]->has_embedding() && !models[0]->has_head());
  EXPECT_TRUE(!models[1]->has_embedding() && !models[1]->has_head());
  EXPECT_TRUE(!models[3]->has_embedding() && models[3]->has_head());
  EXPECT_NE(models[1]->find_submodule("layers.2"), nullptr);
  EXPECT_NE(models[1]->find_submodule("layers.3"), nullptr);
  EXPECT_EQ(models[1]->find_submodule("layers.4"), nullptr);
  EXPECT_EQ(models[1]->layers().size(), 2u);
  loom::testing::expect_error([&] { models[1]->output(); }, {"no output head"});
  loom::testing::expect_error([&] { models[1]->forward_loss(torch::zeros({1, 4}, torch::kLong), torch::zeros({1, 4}, torch::kLong)); },
                        {"forward_loss needs the whole model"});
}

TEST(PipelineSplit, ChainOfPartsIsTheWholeModel) {
  const ModelArgs args = split_test_args();
  Transformer whole(args);
  whole.init_weights(7);
  auto models = stage_models(args, models::stage_layer_bounds(args, {3, 1}), {0, 1, 2});
  const torch::Tensor tokens = torch::randint(0, args.vocab_size, {2, 16});
  const torch::Tensor labels = torch::randint(0, args.vocab_size, {2, 16});
  torch::Tensor x = tokens;
  for (auto& m : models) x = m->forward_part(x, labels);
  EXPECT_TRUE(torch::allclose(x, whole.forward_loss(tokens, labels), 1e-6, 0));
}

// One rank holding every stage: the executor hands activations and gradients over locally.
TEST(PipelineSplit, ExecutorOnOneRankMatchesTheWholeModel) {
  const ModelArgs args = split_test_args();
  Transformer whole(args);
  whole.init_weights(7);
  const torch::Tensor tokens = torch::randint(0, args.vocab_size, {4, 16});
  const torch::Tensor labels = torch::randint(0, args.vocab_size, {4, 16});
  whole.zero_grad();
  const torch::Tensor ref = whole.forward_loss(tokens, labels);
  ref.backward();
  const int m = 4;
  std::vector<torch::Tensor> inputs, targets;
  for (int i = 0; i < m; ++i) inputs.push_back(tokens.narrow(0, i, 1)), targets.push_back(labels.narrow(0, i, 1));
  for (const std::string name : {"Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"}) {
    for (auto method : {pipeline::WeightGradMethod::kPerOp, pipeline::WeightGradMethod::kAutograd}) {
      const pipeline::Schedule schedule = pipeline::build_schedule({name, 1, m, 2});
      auto models = stage_models(args, models::stage_layer_bounds(args, {1, 2}), schedule.stages_of(0));
      auto stages = models::make_pipeline_stages(models, schedule.stages_of(0), 2, method);
      pipeline::PipelineExecutor executor(schedule, stages,
                                          {distributed::Comm::single("pp", 0), {1, 16, args.dim}});
      const double loss = executor.step(inputs, targets);
      EXPECT_NEAR(loss, ref.item<double>(), 1e-6 * ref.item<double>()) << name;
      for (auto& model : models) {
        for (const auto& p : model->named_parameters()) {
          const torch::Tensor& want = whole.parameter(p.name).grad();
          ASSERT_TRUE(p.tensor().grad().defined()) << name << " " << p.name;
          const double diff = (p.tensor().grad() - want).abs().max().item<double>() /
                              want.abs().max().item<double>();
          EXPECT_LE(diff, 1e-5) << name << " " << p.name;
        }
      }
    }
  }
}

TEST(PipelineSplit, ExecutorRefusesStagesTheScheduleDoesNotGiveTheRank) {
  const ModelArgs args = split_test_args();
  const pipeline::Schedule schedule = pipeline::build_schedule({"Interleaved1F1B", 1, 2, 2});
  auto models = stage_models(args, models::stage_layer_bounds(args, {1, 2}), {0});
  auto stages = models::make_pipeline_stages(models, {0}, 2);
  loom::testing::expect_error(
      [&] {
        pipeline::PipelineExecutor(schedule, stages, {distributed::Comm::single("pp", 0), {1, 16, 64}});
      },
      {"pipeline rank 0 holds stages [0] but the schedule gives it [0, 1]"});
}

// What the I/W split costs on a middle stage (2 layers of dim 256, 4 x 64 tokens): B, and I + W for
// both methods, in milliseconds (best of 5). kPerOp's I skips the weight GEMMs and its W is one
// GEMM per Linear, so I + W should cost about B; kAutograd's W walks the graph again. Printed, not
// asserted: timings on a shared machine are not a test.
TEST(PipelineSplit, CostOfTheBackwardSplit) {
  ModelArgs args = split_test_args(4);
  args.dim = 256, args.n_heads = 8, args.n_kv_heads = 4, args.max_seq_len = 64;
  auto models = stage_models(args, models::stage_layer_bounds(args, {2, 1}), {1});
  // A middle stage: the last stage's head and loss would dominate a model this small.
  models[0]->remove_head();
  const torch::Tensor x = torch::randn({4, 64, args.dim});
  const torch::Tensor dy = torch::randn({4, 64, args.dim});
  auto time_ms = [](const std::function<void()>& fn) {
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      fn();
      best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    return best;
  };
  double ms[3][3] = {};  // [B, per-op, autograd][forward, I or B, W]
  for (int variant = 0; variant < 3; ++variant) {
    const auto method = variant == 2 ? pipeline::WeightGradMethod::kAutograd : pipeline::WeightGradMethod::kPerOp;
    pipeline::PipelineStage stage(1, 3, models[0], [&](const torch::Tensor& in, const torch::Tensor&, const nn::TokenLayout&) {
      return models[0]->forward_part(in, {});
    }, method);
    const bool split = variant > 0;
    ms[variant][0] = time_ms([&] { stage.forward(0, x, {}, split); stage.clear(); });
    double b = 1e30, w = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      stage.forward(0, x, {}, split);
      auto t0 = std::chrono::steady_clock::now();
      if (split) stage.backward_input(0, dy); else stage.backward(0, dy);
      auto t1 = std::chrono::steady_clock::now();
      if (split) stage.backward_weight(0);
      auto t2 = std::chrono::steady_clock::now();
      b = std::min(b, std::chrono::duration<double, std::milli>(t1 - t0).count());
      w = std::min(w, std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
    ms[variant][1] = b, ms[variant][2] = split ? w : 0;
  }
  std::printf("forward %.2f ms; B %.2f ms; per-op I %.2f + W %.2f = %.2f ms (%.2f B); autograd I %.2f + W %.2f = %.2f ms (%.2f B)\n",
              ms[0][0], ms[0][1], ms[1][1], ms[1][2], ms[1][1] + ms[1][2], (ms[1][1] + ms[1][2]) / ms[0][1],
              ms[2][1], ms[2][2], ms[2][1] + ms[2][2], (ms[2][1] + ms[2][2]) / ms[0][1]);
}

// The FSDP seam: a schedule lowered with UNSHARD/RESHARD calls the callbacks once per stage per
// step, the unshard before the stage's first compute and the reshard after its last.
TEST(PipelineSplit, UnshardAndReshardActionsCallTheCallbacks) {
  const ModelArgs args = split_test_args(4);
  const pipeline::Schedule schedule = pipeline::build_schedule({"LoopedBFS", 1, 2, 2}, /*fsdp=*/true);
  auto models = stage_models(args, models::stage_layer_bounds(args, {1, 2}), schedule.stages_of(0));
  auto stages = models::make_pipeline_stages(models, schedule.stages_of(0), 2);
  std::vector<std::string> events;
  pipeline::ExecutorOptions options{distributed::Comm::single("pp", 0), {1, 16, args.dim}};
  options.unshard = [&](pipeline::PipelineStage& s) {
    EXPECT_EQ(s.num_pending(), 0u);
    events.push_back("unshard " + std::to_string(s.index()));
  };
  options.reshard = [&](pipeline::PipelineStage& s) {
    EXPECT_EQ(s.num_pending(), 0u);
    events.push_back("reshard " + std::to_string(s.index()));
  };
  pipeline::PipelineExecutor executor(schedule, stages, options);
  const torch::Tensor tokens = torch::randint(0, args.vocab_size, {2, 16});
  executor.step({tokens.narrow(0, 0, 1), tokens.narrow(0, 1, 1)}, {tokens.narrow(0, 0, 1), tokens.narrow(0, 1, 1)});
  EXPECT_EQ(events, (std::vector<std::string>{"unshard 0", "unshard 1", "reshard 1", "reshard 0"}));
}
