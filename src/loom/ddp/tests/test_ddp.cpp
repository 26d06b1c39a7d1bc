// DDP through real processes: each scenario of loom_ddp_worker checks, on every rank, that the
// all-reduced gradients equal the single-process reference over all ranks' batches.
#include <gtest/gtest.h>

#include "loom/testing/run.h"

namespace {
using loom::testing::bin_dir;
using loom::testing::run;

void expect_scenario(int nproc, const std::string& scenario) {
  auto r = run(bin_dir() + "/loom launch --nproc " + std::to_string(nproc) + " --exec -- " +
               bin_dir() + "/loom_ddp_worker " + scenario);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ddp gradients match"), std::string::npos) << r.output;
}
}  // namespace

TEST(DDP, TwoRanksOneBucket) { expect_scenario(2, "grads"); }
TEST(DDP, TwoRanksManyBucketsOverlapped) { expect_scenario(2, "small_buckets"); }
TEST(DDP, ThreeRanksGradientAccumulation) { expect_scenario(3, "accumulate"); }
