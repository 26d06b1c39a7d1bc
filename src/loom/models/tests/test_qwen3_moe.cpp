// Qwen3-MoE (models/qwen3_moe/): its layers on the shared decoder (dense where mlp_only_layers says,
// MoE blocks elsewhere), the published total and active parameter counts, balancing of the
// selection bias through a training step, and training in parallel layouts like the single process
// (the layout tables of train/tests, with model.name = qwen3_moe): the routing decisions and the
// bias depend on every rank's token counts, summed as one process would see them. The Hugging Face
// parity (score, convert round trip, fused layout, generate, info) is
// tests/parity/test_hf_qwen3_moe_parity.py.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/moe_block.h"
#include "loom/models/qwen3_moe/model.h"
#include "loom/models/spec.h"
#include "loom/train/tests/layout_runs.h"

namespace test_qwen3_moe {
using loom::models::get_spec;
using loom::testing::Layout;

TEST(Qwen3Moe, DenseAndSparseLayersAndCounts) {
  const loom::qwen3_moe::ModelArgs args = loom::qwen3_moe::flavor("tiny");
  loom::qwen3_moe::Qwen3Moe model(args, torch::TensorOptions().device(torch::kMeta));
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model.named_parameters()) shapes[p.name] = p.tensor().sizes().vec();
  // Layer 0 is dense (mlp_only_layers), the others MoE: 8 stacked experts of width 64.
  EXPECT_EQ(shapes.at("layers.0.feed_forward.w1.weight"), (std::vector<int64_t>{192, 64}));
  EXPECT_EQ(shapes.count("layers.0.moe.experts.w1"), 0u);
  EXPECT_EQ(shapes.at("layers.1.moe.experts.w1"), (std::vector<int64_t>{8, 64, 64}));
  EXPECT_EQ(shapes.at("layers.1.moe.experts.w2"), (std::vector<int64_t>{8, 64, 64}));
  EXPECT_EQ(shapes.at("layers.3.moe.router.gate.weight"), (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(shapes.count("layers.1.feed_forward.w1.weight"), 0u);
  const auto counted = get_spec("qwen3_moe").count_parameters(args);
  EXPECT_EQ(loom::models::count_parameters(model).total, counted.total);
  EXPECT_EQ(counted.active, counted.total - 3 * (8 - 2) * 3 * 64 * 64);
  // MFU counts the active parameters: fewer FLOPs than a dense model of the same total.
  EXPECT_LT(get_spec("qwen3_moe").flops_per_token(args, 64),
            loom::models::flops_per_token(args, counted.non_embedding, 64));
}

// Totals and active parameters as the model cards state them (billions, to their rounding).
TEST(Qwen3Moe, FlavorsHaveThePublishedCounts) {
  struct Card {
    const char* flavor;
    double total, active;
  };
  for (const Card& card : {Card{"30B-A3B", 30.5, 3.3}, Card{"235B-A22B", 235.1, 22.2}}) {
    const auto c = loom::qwen3_moe::count_parameters(loom::qwen3_moe::flavor(card.flavor));
    EXPECT_NEAR(static_cast<double>(c.total) / 1e9, card.total, 0.06 * card.total / 30) << card.flavor;
    EXPECT_NEAR(static_cast<double>(c.active) / 1e9, card.active, 0.06 * card.active / 3) << card.flavor;
  }
  EXPECT_THROW(loom::qwen3_moe::flavor("30B"), loom::UsageError);
}

// One process: a forward and backward of the debug model routes tokens into every sparse layer's
// counts, and the bias stays zero until a balancing step moves it.
TEST(Qwen3Moe, ForwardCountsTokensForBalancing) {
  loom::qwen3_moe::Qwen3Moe model(loom::qwen3_moe::flavor("tiny"));
  model.init_weights(1);
  const torch::Tensor tokens = torch::randint(0, 2048, {2, 16}, torch::kInt64);
  const torch::Tensor loss = model.forward_loss(tokens, tokens);
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  auto& block = dynamic_cast<loom::models::MoETransformerBlock&>(model.layer("2"));
  EXPECT_EQ(block.moe().tokens_per_expert().sum().item<double>(), 2 * 16 * 2);
  EXPECT_EQ(block.moe().expert_bias().abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(model.parameter("layers.2.moe.experts.w2").grad().defined());
}

// The selection biases are model state: a checkpoint keeps them and a resumed run routes as the
// uninterrupted one, step for step (one process, bitwise). FSDP 2 resumes it too.
TEST(Qwen3Moe, CheckpointsKeepTheSelectionBias) {
  using loom::testing::layout_train_args;
  using loom::testing::loom_command;
  using loom::testing::run;
  using loom::testing::TempDir;
  const std::string flags = "--model.name=qwen3_moe --checkpoint.enable=true --checkpoint.interval=4";
  TempDir full("moe_full");
  auto r = run(loom_command(1, layout_train_args(full, 8, 8, flags)), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto saved = loom::testing::read_whole_checkpoint(full.path() / "checkpoint" / "step-4");
  ASSERT_TRUE(saved.count("layers.1.moe.expert_bias")) << "the selection bias is not in the checkpoint";
  EXPECT_GT(saved.at("layers.1.moe.expert_bias").abs().sum().item<double>(), 0.0);  // it moved in 4 steps
  const auto want = loom::testing::logged_losses(full.path());
  // Every logged step reports each MoE layer's expert loads (over the mean: >= 1 for the busiest,
  // <= 1 for the idlest) and the bias norm.
  const auto rows = loom::testing::read_jsonl(full.path() / "metrics.jsonl");
  ASSERT_FALSE(rows.empty());
  const auto& last = rows.back();
  for (const char* layer : {"layers.1.moe", "layers.2.moe", "layers.3.moe"}) {
    const std::string key = std::string("moe/") + layer;
    ASSERT_TRUE(last.contains(key + "/load_max")) << last.dump();
    EXPECT_GE(last[key + "/load_max"].get<double>(), 1.0);
    EXPECT_LE(last[key + "/load_min"].get<double>(), 1.0);
    EXPECT_GT(last[key + "/bias_norm"].get<double>(), 0.0);
  }
  EXPECT_FALSE(last.contains("moe/layers.0.moe/load_max"));  // layer 0 is dense
  for (int nproc : {1, 2}) {
    TempDir resumed(nproc == 1 ? "moe_resume" : "moe_resume_fsdp2");
    std::filesystem::create_directories(resumed.path() / "checkpoint");
    std::filesystem::copy(full.path() / "checkpoint" / "step-4", resumed.path() / "checkpoint" / "step-4",
                          std::filesystem::copy_options::recursive);
    r = run(loom_command(nproc, layout_train_args(resumed, 8, 8 / nproc, flags)), 300);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto got = loom::testing::logged_losses(resumed.path());
    ASSERT_EQ(got.size(), 4u) << r.output;
    for (size_t i = 0; i < got.size(); ++i) {
      if (nproc == 1) {
        EXPECT_EQ(got[i], want[4 + i]) << "step " << 5 + i;
      } else {
        EXPECT_NEAR(got[i], want[4 + i], 1e-5 * want[4 + i]) << "step " << 5 + i;
      }
    }
  }
}

// The tiny Qwen3-MoE (8 experts, top 2, layer 0 dense) in parallel layouts against the single
// process over 20 steps (8 rows of 64 tokens a step): FSDP 2 (each rank routes its rows, the counts
// summed before the bias moves), TP 2 with sequence parallelism (each rank routes its tokens, the
// replicated experts' gradients summed), PP 2 (1F1B) and CP 2. Per-step losses within 1e-5.
class Qwen3MoeLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(Qwen3MoeLayout, TrainsLikeTheSingleProcess) {
  loom::testing::expect_layout_matches_single_process(GetParam(), "--model.name=qwen3_moe", 20, {1e-5});
}

INSTANTIATE_TEST_SUITE_P(
    EveryLayout, Qwen3MoeLayout,
    ::testing::Values(Layout{"moe_fsdp2", 2, 4, ""},
                      Layout{"moe_tp2", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
                      Layout{"moe_pp2_1f1b", 2, 8, "--parallelism.pipeline_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"
                                                   " --parallelism.pipeline_parallel_schedule=1F1B"
                                                   " --parallelism.pipeline_parallel_microbatch_size=2"},
                      Layout{"moe_cp2", 2, 8, "--parallelism.context_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"}),
    loom::testing::layout_test_name);

}  // namespace test_qwen3_moe
