// FSDP buckets and prefetch depth through `loom train` (issue 28 part 3): the tiny model's four
// blocks merged into two buckets, the next two groups' all-gathers issued ahead, trains like one
// process; and a checkpoint saved with buckets loads bitwise into a run without them and back (the
// names are the model's whatever the grouping, each rank reads its pieces by global offsets).
#include <gtest/gtest.h>

#include <string>

#include "loom/train/tests/layout_runs.h"

namespace loom::train::fsdp_bucket_tests {

using loom::testing::Layout;
using loom::testing::TempDir;

// A tiny block holds ~0.26 MB of float32 parameters, so 0.5 MB buckets take two blocks each.
const std::string kBuckets = " --parallelism.fsdp_bucket_mb=0.5 --parallelism.fsdp_prefetch_depth=2";

TEST(TrainerFsdpBuckets, BucketsAndPrefetchDepthTwoTrainLikeOneProcess) {
  loom::testing::expect_layout_matches_single_process(
      Layout{"fsdp2_buckets_depth2", 2, 4, "--parallelism.data_parallel_shard_degree=2" + kBuckets}, "", 10,
      {1e-5, 1e-5});
}

TEST(TrainerFsdpBuckets, CheckpointSavedWithBucketsLoadsBitwiseWithout) {
  TempDir bucketed("bucketed");
  const std::string save = " --checkpoint.enable=true --checkpoint.interval=1000";
  loom::testing::RunResult r = loom::testing::run(
      loom::testing::loom_command(
          2, loom::testing::layout_train_args(bucketed, 2, 4, "--parallelism.data_parallel_shard_degree=2" + kBuckets + save)),
      300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("FSDP over 2 ranks, 4 groups"), std::string::npos) << r.output;  // 2 buckets, head, root
  const auto step2 = bucketed.path() / "checkpoint" / "step-2";
  TempDir plain("plain"), again("again");
  // One group per block (the default), then buckets again: every tensor round-trips bitwise.
  const auto resaved = loom::testing::resave_checkpoint(plain, step2, 2, 2, save);
  const auto back = loom::testing::resave_checkpoint(again, resaved, 2, 2, save + kBuckets);
  const auto original = loom::testing::read_whole_checkpoint(step2);
  loom::testing::expect_bitwise_equal_checkpoints(original, loom::testing::read_whole_checkpoint(resaved));
  loom::testing::expect_bitwise_equal_checkpoints(original, loom::testing::read_whole_checkpoint(back));
}

}  // namespace loom::train::fsdp_bucket_tests
