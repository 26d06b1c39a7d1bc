// GPT-OSS (models/gpt_oss/): its layers on the shared decoder (sinks, biased projections, a sliding
// window on the layers layer_types marks, the biased softmax-after-top-k router and the clamped
// SwiGLU experts), the published total and active parameter counts, and training in parallel
// layouts like the single process (loss and gradient norm per step, with clipping that engages).
// The Hugging Face parity (score, convert round trip, MXFP4 experts, generate, info) is
// tests/parity/test_hf_gpt_oss_parity.py.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "loom/core/error.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/moe_block.h"
#include "loom/models/gpt_oss/model.h"
#include "loom/models/spec.h"
#include "loom/train/tests/layout_runs.h"

namespace test_gpt_oss {
using loom::models::get_spec;
using loom::testing::Layout;

TEST(GptOss, EveryLayerHasSinksBiasesAndAnMoEAndEvenLayersSlide) {
  const loom::gpt_oss::ModelArgs args = loom::gpt_oss::flavor("tiny");
  loom::gpt_oss::GptOss model(args, torch::TensorOptions().device(torch::kMeta));
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model.named_parameters()) shapes[p.name] = p.tensor().sizes().vec();
  EXPECT_EQ(shapes.at("layers.0.attention.sinks"), (std::vector<int64_t>{4}));
  EXPECT_EQ(shapes.at("layers.1.attention.wq.bias"), (std::vector<int64_t>{64}));
  EXPECT_EQ(shapes.at("layers.1.attention.wk.bias"), (std::vector<int64_t>{32}));
  EXPECT_EQ(shapes.at("layers.1.attention.wo.bias"), (std::vector<int64_t>{64}));
  EXPECT_EQ(shapes.at("layers.0.moe.router.gate.bias"), (std::vector<int64_t>{4}));
  EXPECT_EQ(shapes.at("layers.0.moe.experts.w1"), (std::vector<int64_t>{4, 32, 64}));
  EXPECT_EQ(shapes.at("layers.0.moe.experts.b1"), (std::vector<int64_t>{4, 32}));
  EXPECT_EQ(shapes.at("layers.0.moe.experts.b2"), (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(shapes.count("layers.0.feed_forward.w1.weight"), 0u);
  EXPECT_EQ(model.layer("0").attention().sliding_window(), 8);
  EXPECT_EQ(model.layer("1").attention().sliding_window(), 0);
  EXPECT_TRUE(model.layer("1").attention().has_sinks());
  const auto counted = get_spec("gpt_oss").count_parameters(args);
  EXPECT_EQ(loom::models::count_parameters(model).total, counted.total);
  const int64_t expert = 3 * 64 * 32 + 2 * 32 + 64;
  EXPECT_EQ(counted.active, counted.total - 2 * (4 - 2) * expert);
  // FLOPs: a windowed layer's queries see min(window, T) keys (layer 0: 8 of 1024), not T.
  const double attention = 6.0 * 4 * (16 + 16);
  EXPECT_DOUBLE_EQ(loom::models::flops_per_token(args, 1000, 1024), 6.0 * 1000 + attention * (8 + 1024));
  // An explicit layer_types list replaces the even-layer default.
  loom::gpt_oss::ModelArgs odd = args;
  odd.default_sliding_layers = false;
  odd.sliding_layers_list = {1};
  EXPECT_FALSE(odd.is_sliding(0));
  EXPECT_TRUE(odd.is_sliding(1));
}

// gpt-oss-20b and gpt-oss-120b as the model card states them: 20.91B and 116.83B parameters,
// 3.61B and 5.13B active (the card counts the layers' active weights and one vocabulary table).
TEST(GptOss, FlavorsHaveThePublishedCounts) {
  struct Card {
    const char* flavor;
    double total, active;
  };
  for (const Card& card : {Card{"20B", 20.91, 3.61}, Card{"120B", 116.83, 5.13}}) {
    const auto a = loom::gpt_oss::flavor(card.flavor);
    const auto c = loom::gpt_oss::count_parameters(a);
    EXPECT_NEAR(static_cast<double>(c.total) / 1e9, card.total, 0.005) << card.flavor;
    EXPECT_NEAR(static_cast<double>(c.active - c.embedding) / 1e9, card.active, 0.005) << card.flavor;
  }
  EXPECT_THROW(loom::gpt_oss::flavor("20b-typo"), loom::UsageError);
}

// TorchTitan's initialisation by global name: depth-scaled truncated normals, zero biases for the
// attention and the router, normal(0.02) embedding.
TEST(GptOss, InitialisationFollowsTorchTitan) {
  loom::gpt_oss::GptOss model(loom::gpt_oss::flavor("debugmodel"));
  model.init_weights(3);
  auto std_of = [&](const std::string& name) { return model.parameter(name).std().item<double>(); };
  EXPECT_NEAR(std_of("tok_embeddings.weight"), 0.02, 0.002);
  EXPECT_EQ(model.parameter("layers.1.attention.wq.bias").abs().sum().item<double>(), 0.0);
  EXPECT_EQ(model.parameter("layers.1.moe.router.gate.bias").abs().sum().item<double>(), 0.0);
  const double layer3 = 0.02 / std::sqrt(2.0 * 4);
  EXPECT_NEAR(std_of("layers.3.attention.wq.weight"), layer3, 0.1 * layer3);
  EXPECT_NEAR(std_of("layers.3.moe.experts.w2"), layer3, 0.1 * layer3);
  EXPECT_NEAR(std_of("layers.3.moe.experts.b1"), layer3, 0.2 * layer3);
  EXPECT_GT(model.parameter("layers.0.attention.sinks").abs().sum().item<double>(), 0.0);
  const torch::Tensor tokens = torch::randint(0, 2048, {2, 96}, torch::kInt64);
  const torch::Tensor loss = model.forward_loss(tokens, tokens);
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  EXPECT_TRUE(model.parameter("layers.0.attention.sinks").grad().defined());
  EXPECT_GT(model.parameter("layers.2.moe.experts.b2").grad().abs().sum().item<double>(), 0.0);
}

// A window at least as long as the sequence is full causal attention (allowed, not refused).
TEST(GptOss, AWindowLongerThanTheSequenceIsFullAttention) {
  loom::gpt_oss::ModelArgs windowed = loom::gpt_oss::flavor("tiny");
  windowed.sliding_window = 4096;
  windowed.default_sliding_layers = false;
  windowed.sliding_layers_list = {0, 1};
  loom::gpt_oss::ModelArgs full = windowed;
  full.sliding_layers_list.clear();
  loom::gpt_oss::GptOss a(windowed), b(full);
  a.init_weights(5);
  b.init_weights(5);
  EXPECT_EQ(a.layer("0").attention().sliding_window(), 4096);
  EXPECT_EQ(b.layer("0").attention().sliding_window(), 0);
  const torch::Tensor tokens = torch::randint(0, 2048, {2, 48}, torch::kInt64);
  EXPECT_NEAR(a.forward_loss(tokens, tokens).item<double>(), b.forward_loss(tokens, tokens).item<double>(), 1e-6);
  // A window shorter than the sequence changes what the later tokens see.
  loom::gpt_oss::ModelArgs short_window = windowed;
  short_window.sliding_window = 4;
  loom::gpt_oss::GptOss c(short_window);
  c.init_weights(5);
  EXPECT_GT(std::abs(c.forward_loss(tokens, tokens).item<double>() - b.forward_loss(tokens, tokens).item<double>()), 1e-6);
}

// The tiny GPT-OSS (4 experts, top 2, a window of 8 tokens on even layers) in parallel layouts
// against the single process over 20 steps (8 rows of 64 tokens a step): FSDP 2, TP 2 with
// sequence parallelism (sinks sharded by head, biases with their projections), EP 2 (experts and
// their biases on their ranks), EP 2 x FSDP 2 of the experts (efsdp) on 4 ranks, PP 2 (1F1B) and
// CP 2 (the window crosses the chunks, sinks under the merged softmax). Loss and gradient norm
// per step, clipping engaged.
class GptOssLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(GptOssLayout, TrainsLikeTheSingleProcess) {
  loom::testing::expect_layout_matches_single_process(GetParam(), "--model.name=gpt_oss", 20, {1e-5});
}

INSTANTIATE_TEST_SUITE_P(
    EveryLayout, GptOssLayout,
    ::testing::Values(Layout{"gptoss_fsdp2", 2, 4, ""},
                      Layout{"gptoss_tp2", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
                      Layout{"gptoss_ep2", 2, 4, "--parallelism.expert_parallel_degree=2"},
                      Layout{"gptoss_ep2_efsdp2", 4, 2, "--parallelism.expert_parallel_degree=2"},
                      Layout{"gptoss_pp2_1f1b", 2, 8, "--parallelism.pipeline_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"
                                                      " --parallelism.pipeline_parallel_schedule=1F1B"
                                                      " --parallelism.pipeline_parallel_microbatch_size=2"},
                      Layout{"gptoss_cp2", 2, 8, "--parallelism.context_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"}),
    loom::testing::layout_test_name);

}  // namespace test_gpt_oss
