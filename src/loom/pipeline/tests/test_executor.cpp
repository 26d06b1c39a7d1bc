// The executor on real stages: every schedule on 2 and 4 ranks against the single-process Llama
// (tests/worker/pp_worker.cpp: loss and every owned parameter gradient, then three SGD steps).
// The single-process tests of stages and splitting are in models/tests/test_pipeline_split.cpp.
#include <gtest/gtest.h>

#include <c10/util/StringUtil.h>

#include "loom/testing/run.h"

namespace {

void expect_workers(int nproc) {
  using loom::testing::bin_dir;
  auto r = loom::testing::run(bin_dir() + "/loom launch --nproc " + std::to_string(nproc) +
                                  " --exec -- " + bin_dir() + "/loom_pp_worker parity",
                              300);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < nproc; ++rank) {
    EXPECT_NE(r.output.find(c10::str("rank ", rank, "/", nproc, " parity: ok")), std::string::npos)
        << r.output;
  }
  std::printf("%s", r.output.c_str());
}

}  // namespace

TEST(PipelineExecutor, EveryScheduleMatchesTheSingleProcessModelOnTwoRanks) { expect_workers(2); }
TEST(PipelineExecutor, EveryScheduleMatchesTheSingleProcessModelOnFourRanks) { expect_workers(4); }
