// The pieces of `loom rl` under data parallelism that one process can check: each rank's share of
// the global GRPO loss (global_loss_scale) and the command-line overrides. The multi-rank runs
// themselves are in test_rl_parallel.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "loom/core/error.h"
#include "loom/rl/grpo.h"
#include "loom/rl/parallel_policy.h"
#include "loom/rl/rl_cli.h"
#include "loom/testing/errors.h"

using namespace loom;

// Rows split over two "ranks" (3 and 5 rows, of different widths): the scaled losses of the halves
// sum to the loss of the whole, and so do their gradients, for every aggregation.
TEST(RlGlobalLoss, SharesOfTheRanksSumToTheWholeBatch) {
  torch::manual_seed(0);
  const int64_t rows = 8, width = 7;
  torch::Tensor mask = torch::zeros({rows, width});
  const std::vector<int64_t> lengths = {3, 5, 1, 7, 2, 4, 6, 3};  // rows 0-2 within 5 positions
  for (int64_t i = 0; i < rows; ++i) mask[i].narrow(0, 0, lengths[static_cast<size_t>(i)]).fill_(1);
  const torch::Tensor old = -torch::rand({rows, width}) * 3 * mask;
  const torch::Tensor advantages = torch::randn({rows});
  const torch::Tensor start = (old + 0.3 * torch::randn({rows, width})) * mask;
  for (const auto aggregation :
       {rl::LossAggregation::kSequenceMean, rl::LossAggregation::kTokenMean, rl::LossAggregation::kDrGrpo}) {
    rl::GrpoOptions options;
    options.aggregation = aggregation;
    torch::Tensor whole_logp = start.clone().requires_grad_(true);
    const torch::Tensor whole = rl::grpo_loss(whole_logp, old, {}, advantages, mask, options).loss;
    whole.backward();
    // Rank 0 holds rows 0-2, whose widest completion is 5 positions (its batch is that wide).
    torch::Tensor split_logp = start.clone().requires_grad_(true);
    const auto share = [&](int64_t first, int64_t count, int64_t local_width) {
      const torch::Tensor m = mask.narrow(0, first, count).narrow(1, 0, local_width);
      const double scale = rl::global_loss_scale(aggregation, static_cast<double>(count), m.sum().item<double>(),
                                                 static_cast<double>(local_width), static_cast<double>(rows),
                                                 mask.sum().item<double>(), static_cast<double>(width));
      return rl::grpo_loss(split_logp.narrow(0, first, count).narrow(1, 0, local_width),
                           old.narrow(0, first, count).narrow(1, 0, local_width), {},
                           advantages.narrow(0, first, count), m, options)
                 .loss *
             scale;
    };
    const torch::Tensor total = share(0, 3, 7) + share(3, 5, 7);
    EXPECT_NEAR(total.item<double>(), whole.item<double>(), 1e-6) << static_cast<int>(aggregation);
    if (aggregation != rl::LossAggregation::kDrGrpo) {
      // The narrower local batch of rank 0 (width 5) gives the same share for the means.
      const torch::Tensor narrow_total = share(0, 3, 5) + share(3, 5, 7);
      EXPECT_NEAR(narrow_total.item<double>(), whole.item<double>(), 1e-6) << static_cast<int>(aggregation);
    }
    total.backward();
    EXPECT_TRUE(torch::allclose(split_logp.grad(), whole_logp.grad(), 1e-5, 1e-7)) << static_cast<int>(aggregation);
  }
}

TEST(RlOverrides, CommandLineSetsRlAndJobKeys) {
  const std::string path = (std::filesystem::temp_directory_path() / "rl_overrides.toml").string();
  std::ofstream(path) << "[model]\nname = \"llama3\"\nflavor = \"debugmodel\"\n[lora]\nrank = 4\n"
                      << "[rl]\nprompts = \"p.jsonl\"\ngroup_size = 3\n";
  const auto [job, rl] = rl::load_rl_config(
      path, {"--rl.group_size=5", "--rl.loss_type", "bnpo", "--rl.prompts=q.jsonl", "--training.steps=7",
             "--parallelism.data_parallel_shard_degree=2"});
  EXPECT_EQ(rl.group_size, 5);
  EXPECT_EQ(rl.loss_type, rl::LossAggregation::kTokenMean);
  EXPECT_EQ(rl.prompts, "q.jsonl");
  EXPECT_EQ(job.training.steps, 7);
  EXPECT_EQ(job.parallelism.data_parallel_shard_degree, 2);
  loom::testing::expect_error<UsageError>([&] { rl::load_rl_config(path, {"--rl.group_sise=4"}); },
                                    {"unknown config key 'rl.group_sise'", "rl.group_size"});
  loom::testing::expect_error<UsageError>([&] { rl::load_rl_config(path, {"--rl.group_size=four"}); },
                                    {"rl.group_size", "an integer", "four"});
  loom::testing::expect_error<UsageError>([&] { rl::load_rl_config(path, {"--rl.loss_type=fuzzy"}); },
                                    {"rl.loss_type", "\"grpo\", \"bnpo\" or \"dr_grpo\"", "fuzzy"});
  loom::testing::expect_error<UsageError>([&] { rl::load_rl_config(path, {"--rl.group_size=1"}); }, {"rl.group_size"});
  loom::testing::expect_error<UsageError>([&] { rl::load_rl_config(path, {"--trainig.steps=3"}); },
                                    {"unknown config key 'trainig.steps'"});
}
