// `loom pipeline`, through the binary.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/testing/run.h"

namespace {
using loom::testing::count_occurrences;
using loom::testing::loom_bin;
using loom::testing::run;
using loom::testing::TempDir;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(PipelineCli, SchedulePrintsTheTableBubbleAndPeaksAndWritesATrace) {
  const TempDir dir("pp-cli");
  const auto r = run(loom_bin() + " pipeline schedule --schedule interleaved1f1b --pp 4 --microbatches 8 " +
                     "--stages-per-rank 2 --trace " + dir.str() + "/trace.json --dump-csv " + dir.str() + "/s.csv");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "schedule Interleaved1F1B: pp 4, 2 stages per rank (8 stages, looped), 8 micro-batches"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "stages of each rank: [0 4] [1 5] [2 6] [3 7]")) << r.output;
  EXPECT_TRUE(contains(r.output, "step  rank 0")) << r.output;
  EXPECT_TRUE(contains(r.output, "0SEND_F0")) << r.output;
  EXPECT_TRUE(contains(r.output, "makespan 57, bubble fraction 0.1579")) << r.output;
  EXPECT_TRUE(contains(r.output, "peak activations")) << r.output;
  std::ifstream in(dir.str() + "/trace.json");
  const auto trace = nlohmann::json::parse(in);
  EXPECT_GT(trace["traceEvents"].size(), 8u * 2 * 4);

  // The dumped CSV (with its communication) reads back as the same schedule.
  const auto back = run(loom_bin() + " pipeline schedule --csv " + dir.str() + "/s.csv");
  ASSERT_EQ(back.exit_code, 0) << back.output;
  const auto table = [](const std::string& out) {
    const size_t begin = out.find("step  rank 0");
    return out.substr(begin, out.find("trace: ") - begin);
  };
  EXPECT_EQ(table(back.output), table(r.output));
}

TEST(PipelineCli, MistakesAreOneLineWithExitCode2) {
  const TempDir dir("pp-cli");
  std::ofstream(dir.str() + "/deadlock.csv") << "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n";
  struct Case {
    std::string args, expected;
  };
  const Case cases[] = {
      {"--schedule Interleaved1FB --pp 4 --microbatches 8",
       "error: unknown pipeline schedule 'Interleaved1FB' (did you mean 'Interleaved1F1B'?)"},
      {"--schedule 1F1B --pp 4 --microbatches 2", "error: 1F1B needs at least as many micro-batches as stages (2 < 4)"},
      {"--csv " + dir.str() + "/deadlock.csv",
       "schedule deadlocks: rank 0 waits at 0B0 for 1B0 (rank 1), rank 1 waits at 1F1 for 0F1 (rank 0)"},
      {"--schedule GPipe --pp 4", "error: pipeline schedule --schedule needs --pp and --microbatches"},
      {"--schedule GPipe --pp 2 --microbatches 2 --costs F=x", "error: cost 'F=x' needs a non-negative number"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const auto r = run(loom_bin() + " pipeline schedule " + c.args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, c.expected)) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "\n"), 1) << r.output;
  }
}

TEST(PipelineCli, CompareListsEverySchedule) {
  const auto r = run(loom_bin() + " pipeline compare --pp 4 --microbatches 8");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"GPipe                   1        33         33   0.2727  8 8 8 8",
                           "1F1B                    1        33         33   0.2727  4 3 2 1",
                           "Interleaved1F1B         2        57       28.5   0.1579",
                           "ZBVZeroBubble           2        51       25.5   0.0588"}) {
    EXPECT_TRUE(contains(r.output, line)) << line << "\n" << r.output;
  }
}

}  // namespace
