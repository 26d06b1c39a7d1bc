// Context parallelism through `loom train` (issue 12's acceptance): every CP layout trains the
// tiny model like the single process with the same global batch, step by step, for causal and
// block-causal (document-masked) attention, with both rotate methods, and composed with FSDP and
// TP; on the default corpus at sequence length 64.
//
// Tolerance: CP splits each attention row's softmax into blocks merged by log-sum-exp, and FSDP
// over dp_shard x cp averages gradients across ranks, so sums run in another order than in one
// process: per-step losses agree to float32 rounding (within 1e-5 relative, measured below),
// not bitwise. lr 1e-3 as in test_trainer_tp.cpp (the debug config's 4e-3 spikes and amplifies
// any rounding difference ~100x).
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

// Each layout against the one cached single-process run with the same mask (layout_runs.h), 10
// steps: per-step losses within 1e-5.
void expect_cp_layouts_match_single_process(const std::string& mask, const std::vector<Layout>& layouts) {
  for (const Layout& l : layouts) {
    loom::testing::expect_layout_matches_single_process(l, "--model.attention_mask=" + mask, 10, {1e-5});
  }
}

}  // namespace

// CP 2 and 4 with each rotate method; the cp ranks share each row, so the local batch is the
// global one (8 rows).
TEST(TrainerCP, CausalLayoutsTrainLikeTheSingleProcess) {
  expect_cp_layouts_match_single_process(
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
  expect_cp_layouts_match_single_process(
      "block_causal", {
                          {"cp2_allgather", 2, 8, "--parallelism.context_parallel_degree=2"},
                          {"cp2_ring", 2, 8, "--parallelism.context_parallel_degree=2 --parallelism.context_parallel_rotate_method=ring"},
                          {"cp4_allgather", 4, 8, "--parallelism.context_parallel_degree=4"},
                          {"cp4_ring", 4, 8, "--parallelism.context_parallel_degree=4 --parallelism.context_parallel_rotate_method=ring"},
                      });
}

// 3-D: FSDP 2 x CP 2 x TP 2 on 8 ranks.
TEST(TrainerCP, FsdpCpTpOnEightRanksTrainsLikeTheSingleProcess) {
  expect_cp_layouts_match_single_process(
      "causal", {{"fsdp2_cp2_tp2", 8, 4,
                  "--parallelism.context_parallel_degree=2 --parallelism.tensor_parallel_degree=2"
                  " --parallelism.data_parallel_shard_degree=2"}});
}
