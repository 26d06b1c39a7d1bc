// DeepSeek-V3 (models/deepseek_v3/): its blocks (a dense first layer, MoE with shared experts after
// it, multi-head latent attention in all), the published parameter counts, and training in parallel
// layouts like the single process (20 steps of the tiny flavor, per-step losses within 1e-5, the
// gathered final parameters within 1e-4): FSDP 2, TP 2 (MLA's heads split), EP 2, EP 2 with FSDP
// over efsdp 2 (4 ranks), PP 2 with EP 2 (4 ranks), CP 2 (ring attention with value heads narrower
// than the keys). The Hugging Face parity (score, YaRN, round trip, fused experts, fp8 blocks,
// generate, info) is tests/parity/test_hf_deepseek_v3_parity.py.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/models/deepseek_v3/model.h"
#include "loom/models/spec.h"
#include "loom/testing/errors.h"
#include "loom/train/tests/layout_runs.h"

namespace test_deepseek_v3 {
using loom::testing::Layout;

TEST(DeepSeekV3, DenseFirstLayersThenMoEWithSharedExperts) {
  const loom::deepseek_v3::ModelArgs args = loom::deepseek_v3::flavor("tiny");
  loom::deepseek_v3::DeepSeekV3 model(args, torch::TensorOptions().device(torch::kMeta));
  auto& dense = dynamic_cast<loom::deepseek_v3::DeepSeekV3Block&>(model.layer("0"));
  auto& sparse = dynamic_cast<loom::deepseek_v3::DeepSeekV3Block&>(model.layer("1"));
  EXPECT_FALSE(dense.is_sparse());
  ASSERT_TRUE(sparse.is_sparse());
  EXPECT_TRUE(sparse.moe().has_shared_experts());
  EXPECT_TRUE(sparse.moe().expert_bias().defined());
  EXPECT_EQ(model.parameter("layers.1.attention.wq_a.weight").sizes(), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(model.parameter("layers.1.attention.wkv_b.weight").sizes(),
            (std::vector<int64_t>{4 * (16 + 16), 32}));
  const auto counted = loom::models::get_spec("deepseek_v3").count_parameters(args);
  int64_t built = 0;
  for (const auto& p : model.named_parameters()) built += p.tensor().numel();
  EXPECT_EQ(counted.total, built);
  // One training forward on real values routes every token and counts it.
  loom::deepseek_v3::DeepSeekV3 real(args);
  real.init_weights(3);
  const torch::Tensor tokens = torch::randint(0, 2048, {2, 16}, torch::kInt64);
  const torch::Tensor loss = real.forward_loss(tokens, tokens);
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  auto& block = dynamic_cast<loom::deepseek_v3::DeepSeekV3Block&>(real.layer("2"));
  EXPECT_EQ(block.moe().tokens_per_expert().sum().item<double>(), 2 * 16 * args.n_activated_experts);
}

// The published sizes: DeepSeek-V2-Lite 15.7B (TorchTitan's 16B config), DeepSeek-V2 236B / 21B
// active, DeepSeek-V3 671B / 37B active, within 0.5 %.
TEST(DeepSeekV3, FlavorsHaveThePublishedCounts) {
  struct Case {
    const char* flavor;
    double total, active;
  };
  for (const Case& c : {Case{"16B", 15.7e9, 0}, Case{"236B", 236e9, 21e9}, Case{"671B", 671e9, 37e9}}) {
    const auto counts = loom::models::get_spec("deepseek_v3").count_parameters(loom::deepseek_v3::flavor(c.flavor));
    EXPECT_NEAR(static_cast<double>(counts.total) / c.total, 1.0, 0.005) << c.flavor << " " << counts.total;
    if (c.active > 0) {
      EXPECT_NEAR(static_cast<double>(counts.active) / c.active, 1.0, 0.03) << c.flavor << " " << counts.active;
    }
    std::printf("%s: total %.3fB, active %.3fB\n", c.flavor, counts.total / 1e9, counts.active / 1e9);
  }
}

TEST(DeepSeekV3, BadArgsAreOneLineUsageErrors) {
  loom::deepseek_v3::ModelArgs a = loom::deepseek_v3::flavor("tiny");
  a.qk_rope_head_dim = 7;
  a.qk_nope_head_dim = 17;  // the head stays even: the rope part's own rule speaks
  a.fixed_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim;
  loom::testing::expect_error<loom::UsageError>([&] { a.validate(); }, {"qk_rope_head_dim must be even"});
  a = loom::deepseek_v3::flavor("tiny");
  a.n_limited_groups = 3;
  loom::testing::expect_error<loom::UsageError>([&] { a.validate(); }, {"topk_groups must be in [1, n_groups = 2]"});
  a = loom::deepseek_v3::flavor("tiny");
  a.load_balance_coeff = 0;
  loom::testing::expect_error<loom::UsageError>([&] { a.validate(); }, {"load_balance_coeff must be > 0"});
}

class DeepSeekV3Layout : public ::testing::TestWithParam<Layout> {};

TEST_P(DeepSeekV3Layout, TrainsLikeTheSingleProcess) {
  loom::testing::expect_layout_matches_single_process(GetParam(), "--model.name=deepseek_v3", 20, {1e-5, 1e-4});
}

INSTANTIATE_TEST_SUITE_P(
    EveryLayout, DeepSeekV3Layout,
    ::testing::Values(
        Layout{"dsv3_fsdp2", 2, 4, ""},
        Layout{"dsv3_tp2", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
        Layout{"dsv3_ep2", 2, 4, "--parallelism.expert_parallel_degree=2"},
        Layout{"dsv3_ep2_efsdp2", 4, 2, "--parallelism.expert_parallel_degree=2"},
        Layout{"dsv3_pp2_ep2", 4, 4,
               "--parallelism.pipeline_parallel_degree=2 --parallelism.expert_parallel_degree=2"
               " --parallelism.pipeline_parallel_schedule=1F1B --parallelism.pipeline_parallel_microbatch_size=2"},
        Layout{"dsv3_cp2", 2, 8, "--parallelism.context_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"}),
    loom::testing::layout_test_name);

}  // namespace test_deepseek_v3
