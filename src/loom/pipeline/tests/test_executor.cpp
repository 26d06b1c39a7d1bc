// The executor on real stages: every schedule on 2 and 4 ranks against the single-process Llama
// (tests/worker/pp_worker.cpp: loss and every owned parameter gradient, then three SGD steps).
// The single-process tests of stages and splitting are in models/tests/test_pipeline_split.cpp.
#include <gtest/gtest.h>

#include <c10/util/StringUtil.h>

#include "loom/testing/worker.h"

namespace {

void expect_workers(int nproc) { loom::testing::expect_workers("loom_pp_worker", "parity", nproc); }

}  // namespace

TEST(PipelineExecutor, EveryScheduleMatchesTheSingleProcessModelOnTwoRanks) { expect_workers(2); }
TEST(PipelineExecutor, EveryScheduleMatchesTheSingleProcessModelOnFourRanks) { expect_workers(4); }
