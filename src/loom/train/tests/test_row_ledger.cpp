// The rows ledger check (train/row_ledger.h): every row once, in order; a resume supersedes the
// steps logged after it; a gap or a repeat is named.
#include <gtest/gtest.h>

#include <fstream>

#include "loom/testing/run.h"
#include "loom/train/row_ledger.h"

namespace loom::train {
namespace {

std::filesystem::path write_metrics(const testing::TempDir& dir, const std::vector<std::string>& lines) {
  const auto path = dir.path() / "metrics.jsonl";
  std::ofstream out(path);
  for (const auto& l : lines) out << l << "\n";
  return path;
}

TEST(RowLedger, EveryRowOnceAcrossAMembershipChangeWhoseStepWasTrainedAgain) {
  testing::TempDir dir("ledger");
  write_metrics(dir, {R"({"event":"membership","generation":0})", R"({"event":"rows","step":1,"rows":[0,12]})",
                      R"({"step":1,"loss":8.0})", R"({"event":"rows","step":2,"rows":[12,24]})",
                      // a membership change after step 1: step 2 is trained again on the same rows
                      R"({"event":"resume","step":1})", R"({"event":"membership","generation":1})",
                      R"({"event":"rows","step":2,"rows":[12,24]})", R"({"event":"rows","step":3,"rows":[24,36]})"});
  const RowLedger ledger = check_row_ledger(dir.path());
  EXPECT_TRUE(ledger.ok()) << ledger.problem;
  EXPECT_EQ(ledger.steps, 3);
  EXPECT_EQ(ledger.rows, 36);
  EXPECT_EQ(ledger.memberships, 2);
  EXPECT_EQ(ledger.superseded, 1);
  EXPECT_EQ(ledger.describe(), "rows [0, 36) trained exactly once over 3 step(s); 2 membership(s); 1 ledger "
                               "line(s) superseded by re-run steps");
}

TEST(RowLedger, SkippedAndRepeatedRowsAndStepsAreNamed) {
  testing::TempDir a("ledger_gap"), b("ledger_twice"), c("ledger_step"), d("ledger_dup");
  write_metrics(a, {R"({"event":"rows","step":1,"rows":[0,12]})", R"({"event":"rows","step":2,"rows":[24,36]})"});
  EXPECT_EQ(check_row_ledger(a.path()).problem, "rows [12, 24) were never trained (step 2 starts at row 24)");
  write_metrics(b, {R"({"event":"rows","step":1,"rows":[0,12]})", R"({"event":"rows","step":2,"rows":[6,18]})"});
  EXPECT_EQ(check_row_ledger(b.path()).problem, "rows [6, 12) were trained twice (step 2 starts at row 6)");
  write_metrics(c, {R"({"event":"rows","step":1,"rows":[0,12]})", R"({"event":"rows","step":3,"rows":[12,24]})"});
  EXPECT_EQ(check_row_ledger(c.path()).problem, "step 2 has no ledger line (the next is step 3)");
  write_metrics(d, {R"({"event":"rows","step":1,"rows":[0,12]})", R"({"event":"rows","step":1,"rows":[0,12]})"});
  EXPECT_NE(check_row_ledger(d.path()).problem.find("step 1 has two ledger lines"), std::string::npos);
}

}  // namespace
}  // namespace loom::train
