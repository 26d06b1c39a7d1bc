// Qwen3 (models/qwen3/): its module layout on the shared decoder (QK-norm, a stated head width, a
// tied head), the published parameter counts of every flavor, its refusals, and training in every
// parallel layout like the single process (the layout tables of train/tests, with model.name =
// qwen3). The Hugging Face parity (score, convert round trip, generate) is
// tests/parity/test_hf_qwen3_parity.py.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/tp_plan.h"
#include "loom/models/qwen3/model.h"
#include "loom/models/qwen3/spec.h"
#include "loom/models/spec.h"
#include "loom/testing/errors.h"
#include "loom/train/tests/layout_runs.h"

namespace test_qwen3 {
using loom::models::get_spec;
using loom::testing::Layout;

const auto kMeta = torch::TensorOptions().device(torch::kMeta);

TEST(Qwen3, ModuleLayoutQkNormStatedHeadDimAndTiedHead) {
  const loom::qwen3::ModelArgs args = loom::qwen3::flavor("debugmodel");
  loom::qwen3::Qwen3 model(args, kMeta);
  EXPECT_EQ(args.head_dim(), 64);  // not dim / n_heads = 32
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model.named_parameters()) shapes[p.name] = p.tensor().sizes().vec();
  EXPECT_EQ(shapes.count("output.weight"), 0u);  // tied: the head is tok_embeddings
  EXPECT_EQ(shapes.at("layers.0.attention.wq.weight"), (std::vector<int64_t>{8 * 64, 256}));
  EXPECT_EQ(shapes.at("layers.0.attention.wk.weight"), (std::vector<int64_t>{4 * 64, 256}));
  EXPECT_EQ(shapes.at("layers.0.attention.wo.weight"), (std::vector<int64_t>{256, 8 * 64}));
  EXPECT_EQ(shapes.at("layers.5.attention.q_norm.weight"), (std::vector<int64_t>{64}));
  EXPECT_EQ(shapes.at("layers.5.attention.k_norm.weight"), (std::vector<int64_t>{64}));
  const auto counts = loom::models::count_parameters(model);
  EXPECT_EQ(counts.total, loom::models::count_transformer_parameters(args).total);
  EXPECT_EQ(counts.total, get_spec("qwen3").count_parameters(args).total);

  // Initialized on the CPU: the QK-norms start at one, the tied head follows the output's std.
  loom::qwen3::Qwen3 cpu(args);
  cpu.init_weights(3);
  EXPECT_TRUE(torch::equal(cpu.parameter("layers.2.attention.k_norm.weight"), torch::ones({64})));
  const double std = cpu.parameter("tok_embeddings.weight").std().item<double>();
  EXPECT_NEAR(std, 1.0 / std::sqrt(256.0), 0.01);
  const torch::Tensor tokens = torch::randint(0, 2048, {2, 16}, torch::kInt64);
  const torch::Tensor labels = torch::randint(0, 2048, {2, 16}, torch::kInt64);
  const torch::Tensor loss = cpu.forward_loss(tokens, labels);
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  // Logits of O(1) at initialization: near the uniform distribution's log(vocab), not far above.
  EXPECT_GT(loss.item<double>(), std::log(2048.0) - 0.5);
  EXPECT_LT(loss.item<double>(), std::log(2048.0) + 2.5);
}

// Totals as the Qwen3 model cards state them (billions, to their rounding), and the non-embedding
// counts the cards give (which leave out an untied lm_head too).
TEST(Qwen3, FlavorsHaveThePublishedParameterCounts) {
  struct Card {
    const char* flavor;
    double total, non_embedding;
  };
  for (const Card& card : {Card{"0.6B", 0.6, 0.44}, Card{"1.7B", 1.7, 1.4}, Card{"4B", 4.0, 3.6}, Card{"8B", 8.2, 6.95},
                           Card{"14B", 14.8, 13.2}, Card{"32B", 32.8, 31.2}}) {
    const loom::qwen3::ModelArgs a = loom::qwen3::flavor(card.flavor);
    const auto c = loom::models::count_transformer_parameters(a);
    const double head = a.tie_embeddings ? 0.0 : static_cast<double>(a.vocab_size * a.dim);
    EXPECT_NEAR(static_cast<double>(c.total) / 1e9, card.total, 0.05) << card.flavor;
    EXPECT_NEAR((static_cast<double>(c.non_embedding) - head) / 1e9, card.non_embedding, 0.05) << card.flavor;
    EXPECT_EQ(a.tie_embeddings, card.total < 5) << card.flavor;
  }
  EXPECT_THROW(loom::qwen3::flavor("7B"), loom::UsageError);
}

TEST(Qwen3, TiedHeadRefusesPipelineAndTensorParallelWithoutLossParallel) {
  const auto& spec = get_spec("qwen3");
  const auto args = spec.build_args({"debugmodel", 2048, 64, 0});
  loom::models::PipelineOptions pp;
  pp.microbatches = 2;
  loom::testing::expect_error<loom::UsageError>(
      [&] { spec.validate_layout(*args, loom::distributed::ParallelDims({1, 1, 1, 1, 2}, 2, 0), 64, {}, pp); },
      {"ties its output head", "pipeline_parallel_degree = 1"});
  loom::models::TensorParallelOptions no_loss_parallel;
  no_loss_parallel.loss_parallel = false;
  loom::testing::expect_error<loom::UsageError>(
      [&] { spec.validate_layout(*args, loom::distributed::ParallelDims({1, 1, 1, 2, 1}, 2, 0), 64, no_loss_parallel, pp); },
      {"ties its output head", "disable_loss_parallel = false"});
  // The untied flavor splits into stages.
  const auto untied = spec.build_args({"tiny", 2048, 64, 0});
  spec.validate_layout(*untied, loom::distributed::ParallelDims({1, 1, 1, 1, 2}, 2, 0), 64, {}, pp);
}

// Qwen3 in every layout the issue names, 20 steps against the single process with the same global
// batch (8 rows): FSDP 2, TP 2 (sequence and loss parallel; the QK-norm gradients summed over the
// group), PP 2 with 1F1B, CP 2; and the tied head (debugmodel cut to 1 layer) under TP 2, whose
// embedding is the vocabulary-sharded head of loss parallel and gets gradients from both its uses.
// Per-step losses within 1e-5 relative (reduction order differs across ranks, as for Llama 3's
// tables).
class Qwen3Layout : public ::testing::TestWithParam<Layout> {};

TEST_P(Qwen3Layout, TrainsLikeTheSingleProcess) {
  const bool tied = std::string(GetParam().name).find("tied") != std::string::npos;
  const std::string model = tied ? "--model.name=qwen3 --model.flavor=debugmodel --model.n_layers=1" : "--model.name=qwen3";
  loom::testing::expect_layout_matches_single_process(GetParam(), model, 20, {1e-5});
}

INSTANTIATE_TEST_SUITE_P(
    EveryLayout, Qwen3Layout,
    ::testing::Values(Layout{"fsdp2", 2, 4, ""},
                      Layout{"tp2", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
                      Layout{"pp2_1f1b", 2, 8, "--parallelism.pipeline_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"
                                               " --parallelism.pipeline_parallel_schedule=1F1B"
                                               " --parallelism.pipeline_parallel_microbatch_size=2"},
                      Layout{"cp2", 2, 8, "--parallelism.context_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
                      Layout{"tied_tp2", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"}),
    loom::testing::layout_test_name);

}  // namespace test_qwen3
