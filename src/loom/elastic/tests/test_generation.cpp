// How a layout shrinks and regrows with its membership (elastic/generation.h).
#include <gtest/gtest.h>

#include "loom/elastic/generation.h"

namespace loom::elastic {
namespace {

BaseLayout fsdp(int64_t shard, int64_t local, int64_t global) {
  BaseLayout b;
  b.dp_shard = shard;
  b.local_batch_size = local;
  b.global_batch_size = global;
  return b;
}

TEST(Generation, FsdpOfFourLosesOneAndKeepsTheGlobalBatchInSmallerMicroBatches) {
  const BaseLayout base = fsdp(4, 3, 12);
  const GenerationLayout first = plan_generation(base, {}, {0, 1, 2, 3});
  EXPECT_EQ(first.trainers, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(first.dp_shard, 4);
  EXPECT_EQ(first.local_batch_size, 3);
  const GenerationLayout shrunk = plan_generation(base, first, {0, 2, 3});
  EXPECT_EQ(shrunk.trainers, (std::vector<int64_t>{0, 2, 3}));
  EXPECT_EQ(shrunk.dp_shard, 3);
  EXPECT_EQ(shrunk.dp_replicate, 1);
  // 12 rows over 3 ranks: 4 each, as 2 micro-batches of 2 (3 does not divide 4).
  EXPECT_EQ(shrunk.local_batch_size, 2);
  EXPECT_TRUE(shrunk.spares.empty());
  // The replacement (member 4) takes the last place; the survivors keep theirs.
  const GenerationLayout regrown = plan_generation(base, shrunk, {0, 2, 3, 4});
  EXPECT_EQ(regrown.trainers, (std::vector<int64_t>{0, 2, 3, 4}));
  EXPECT_EQ(regrown.dp_shard, 4);
  EXPECT_EQ(regrown.local_batch_size, 3);
}

TEST(Generation, AGlobalBatchThatDoesNotDivideLeavesASpare) {
  const BaseLayout base = fsdp(4, 2, 8);
  const GenerationLayout first = plan_generation(base, {}, {0, 1, 2, 3});
  const GenerationLayout shrunk = plan_generation(base, first, {0, 1, 3});
  EXPECT_EQ(shrunk.trainers, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(shrunk.spares, (std::vector<int64_t>{3}));
  EXPECT_EQ(shrunk.local_batch_size, 2);  // 8 rows over 2: 4 each, 2 micro-batches of 2
}

TEST(Generation, HsdpLosingARankBecomesFsdpOverTheRestAndComesBack) {
  BaseLayout base = fsdp(2, 3, 12);
  base.dp_replicate = 2;
  const GenerationLayout first = plan_generation(base, {}, {0, 1, 2, 3});
  EXPECT_EQ(first.dp_replicate, 2);
  const GenerationLayout shrunk = plan_generation(base, first, {0, 1, 3});
  EXPECT_EQ(shrunk.dp_replicate, 1);
  EXPECT_EQ(shrunk.dp_shard, 3);
  const GenerationLayout regrown = plan_generation(base, shrunk, {0, 1, 3, 4});
  EXPECT_EQ(regrown.dp_replicate, 2);
  EXPECT_EQ(regrown.dp_shard, 2);
}

TEST(Generation, ATensorParallelGroupLosesItsReplicaAndItsOrphanWaits) {
  BaseLayout base = fsdp(2, 2, 4);
  base.tp = 2;
  // Ranks [dp0 tp0, dp0 tp1, dp1 tp0, dp1 tp1] = members 0..3; member 1 is lost.
  const GenerationLayout first = plan_generation(base, {}, {0, 1, 2, 3});
  const GenerationLayout shrunk = plan_generation(base, first, {0, 2, 3});
  EXPECT_EQ(shrunk.trainers, (std::vector<int64_t>{2, 3}));  // the whole replica, tp order kept
  EXPECT_EQ(shrunk.spares, (std::vector<int64_t>{0}));
  EXPECT_EQ(shrunk.dp_shard, 1);
  EXPECT_EQ(shrunk.local_batch_size, 2);  // 4 rows on one replica: 2 micro-batches of 2
  // The replacement completes a replica with the orphan.
  const GenerationLayout regrown = plan_generation(base, shrunk, {0, 2, 3, 4});
  EXPECT_EQ(regrown.trainers, (std::vector<int64_t>{2, 3, 0, 4}));
  EXPECT_EQ(regrown.dp_shard, 2);
}

TEST(Generation, WorldRanksFollowTheMeshOrder) {
  BaseLayout base = fsdp(2, 1, 2);
  base.tp = 2;
  base.pp = 2;
  // [pp, dp, cp, tp]: rank = ((pp * 2 + dp) * 1 + cp) * 2 + tp
  EXPECT_EQ(world_rank(base, 2, 1, 0, 0, 1), 5);
  EXPECT_EQ(data_parallel_index(base, 2, 5), 0);
  EXPECT_EQ(model_parallel_index(base, 2, 5), 3);  // pp 1, tp 1
  EXPECT_EQ(data_parallel_index(base, 2, 2), 1);
}

TEST(Generation, NoWholeReplicaMeansEveryoneWaits) {
  BaseLayout base = fsdp(1, 1, 1);
  base.tp = 2;
  const GenerationLayout first = plan_generation(base, {}, {0, 1});
  const GenerationLayout lost = plan_generation(base, first, {1});
  EXPECT_TRUE(lost.trainers.empty());
  EXPECT_EQ(lost.spares, (std::vector<int64_t>{1}));
}

}  // namespace
}  // namespace loom::elastic
