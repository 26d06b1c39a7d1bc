// FSDP through real processes: each scenario of loom_fsdp_worker trains a tiny Llama under
// fully_shard in several configurations and checks, on every rank, per-step losses and final
// parameters against the single-process reference and the bytes moved against the ANCHORS
// formulas (see tests/worker/fsdp_worker.cpp). The worker's per-configuration lines (measured
// wire bytes, padding, ms/step) are echoed to the test log.
#include <gtest/gtest.h>

#include <cstdio>

#include "loom/testing/run.h"

namespace {
using loom::testing::bin_dir;
using loom::testing::run;

void expect_scenario(int nproc, const std::string& scenario) {
  auto r = run(bin_dir() + "/loom launch --nproc " + std::to_string(nproc) + " --exec -- " +
                   bin_dir() + "/loom_fsdp_worker " + scenario,
               /*limit_seconds=*/240);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("fsdp scenario " + scenario + " passed"), std::string::npos) << r.output;
  std::printf("%s(%.1f s)\n", r.output.c_str(), r.seconds);
}
}  // namespace

// ZeRO-3 and ZeRO-2 x {element, row, 32-row} x accumulation with/without resync, + bf16 params,
// + ZeRO-3 accumulating with the parameters held gathered (FsdpSync, fsdp_accumulate_unsharded).
TEST(FSDPMultiRank, TwoRanks) { expect_scenario(2, "fsdp"); }
// Same on four ranks (more padding, more split tensors).
TEST(FSDPMultiRank, FourRanks) { expect_scenario(4, "fsdp"); }
// reshard_after_forward = 2 on four ranks: backward all-gathers over 2-rank sub-groups.
TEST(FSDPMultiRank, FourRanksHpZ2) { expect_scenario(4, "hpz"); }
// HSDP 2 x 2 (ZeRO-3 x granularities, ZeRO-2, ZeRO-3 held across micro-batches) and the bad-policy
// errors.
TEST(FSDPMultiRank, Hsdp2x2AndBadPolicies) { expect_scenario(4, "hsdp"); }
