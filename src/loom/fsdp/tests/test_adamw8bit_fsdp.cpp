// AdamW8bit on FSDP shards through real processes: with the planner's block granularity each
// rank's shard holds whole quantization blocks, so FSDP 2 and FSDP 4 update every parameter
// bitwise like one process (see tests/worker/adamw8bit_worker.cpp).
#include <gtest/gtest.h>

#include "loom/testing/worker.h"

TEST(AdamW8bitFSDP, TwoRanksUpdateBitwiseLikeOneProcess) {
  loom::testing::expect_workers("loom_fsdp_adamw8bit_worker", "adamw8bit", 2, 120);
}

TEST(AdamW8bitFSDP, FourRanksUpdateBitwiseLikeOneProcess) {
  loom::testing::expect_workers("loom_fsdp_adamw8bit_worker", "adamw8bit", 4, 120);
}

TEST(AdamW8bitFSDP, OneRankUpdatesBitwiseLikeOneProcess) {
  loom::testing::expect_workers("loom_fsdp_adamw8bit_worker", "adamw8bit", 1, 120);
}
