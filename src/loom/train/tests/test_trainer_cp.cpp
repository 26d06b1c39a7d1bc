// Context parallelism through `loom train` (issue 12's acceptance): every CP layout trains the
// debug model like the single process with the same global batch, step by step, for causal and
// block-causal (document-masked) attention, with both rotate methods, and composed with FSDP and
// TP. Runs the debug model on the default corpus at sequence length 64.
//
// Tolerance: CP splits each attention row's softmax into blocks merged by log-sum-exp, and FSDP
// over dp_shard x cp averages gradients across ranks, so sums run in another order than in one
// process: per-step losses agree to float32 rounding (within 1e-5 relative, measured below),
// not bitwise. lr 1e-3 as in test_trainer_tp.cpp (the debug config's 4e-3 spikes near step 20
// and amplifies any rounding difference ~100x).
#include <gtest/gtest.h>

#include <cmath>

#include "loom/train/tests/layout_runs.h"

namespace {
using loom::testing::bin_dir;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

using loom::testing::Layout;
using loom::testing::worst_relative;

using loom::testing::layout_train_args;
using loom::testing::loom_command;

void expect_layouts_match_single_process(const std::string& mask, const std::vector<Layout>& layouts) {
  constexpr int kSteps = 20;
  const std::string common = "--model.attention_mask=" + mask;
  TempDir reference("single");
  RunResult ref = run(loom_command(1, layout_train_args(reference, kSteps, 8, common + " --parallelism.data_parallel_shard_degree=1")), 600);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const auto want = loom::testing::logged_losses(reference.path());
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
  EXPECT_LT(want.back(), want.front());
  for (const Layout& l : layouts) {
    TempDir dir(l.name);
    RunResult r = run(loom_command(l.nproc, layout_train_args(dir, kSteps, l.local_batch, common + " " + l.flags)), 600);
    ASSERT_EQ(r.exit_code, 0) << l.name << "\n" << r.output;
    const auto got = loom::testing::logged_losses(dir.path());
    ASSERT_EQ(got.size(), want.size()) << l.name;
    const double worst = worst_relative(want, got);
    EXPECT_LE(worst, 1e-5) << l.name;
    std::printf("%-8s %-26s %d ranks, %d steps: max relative loss difference from the single process %.2e "
                "(final %.6f vs %.6f)\n", mask.c_str(), l.name, l.nproc, kSteps, worst, got.back(), want.back());
  }
}

}  // namespace

// CP 2 and 4 with each rotate method; the cp ranks share each row, so the local batch is the
// global one (8 rows).
TEST(TrainerCP, CausalLayoutsTrainLikeTheSingleProcess) {
  expect_layouts_match_single_process(
      "causal", {
                    {"cp2_allgather", 2, 8, "--parallelism.context_parallel_degree=2"},
                    {"cp2_ring", 2, 8, "--parallelism.context_parallel_degree=2 --parallelism.context_parallel_rotate_method=ring"},
                    {"cp4_allgather", 4, 8, "--parallelism.context_parallel_degree=4"},
                    {"cp4_ring", 4, 8, "--parallelism.context_parallel_degree=4 --parallelism.context_parallel_rotate_method=ring"},
                    {"fsdp2_cp2", 4, 4, "--parallelism.context_parallel_degree=2 --parallelism.data_parallel_shard_degree=2"},
                    {"tp2_cp2", 4, 8, "--parallelism.context_parallel_degree=2 --parallelism.tensor_parallel_degree=2"},
                });
}

TEST(TrainerCP, BlockCausalLayoutsTrainLikeTheSingleProcess) {
  expect_layouts_match_single_process(
      "block_causal", {
                          {"cp2_allgather", 2, 8, "--parallelism.context_parallel_degree=2"},
                          {"cp2_ring", 2, 8, "--parallelism.context_parallel_degree=2 --parallelism.context_parallel_rotate_method=ring"},
                          {"cp4_allgather", 4, 8, "--parallelism.context_parallel_degree=4"},
                          {"cp4_ring", 4, 8, "--parallelism.context_parallel_degree=4 --parallelism.context_parallel_rotate_method=ring"},
                      });
}

// 3-D: FSDP 2 x CP 2 x TP 2 on 8 ranks.
TEST(TrainerCP, FsdpCpTpOnEightRanksTrainsLikeTheSingleProcess) {
  expect_layouts_match_single_process(
      "causal", {{"fsdp2_cp2_tp2", 8, 4,
                  "--parallelism.context_parallel_degree=2 --parallelism.tensor_parallel_degree=2"
                  " --parallelism.data_parallel_shard_degree=2"}});
}
