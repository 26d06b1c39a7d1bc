// Elastic training (issue 48, docs/fault_tolerance.md): a job under `loom launch` with
// fault_tolerance.enable loses a rank, keeps going on the survivors -- same processes, re-sharded
// from their memory -- takes a replacement back at a step boundary, and trains the same model as a
// run that never failed: losses and gradient norms (clipping engaged) step by step, and every row
// exactly once by the rows ledger.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include "loom/core/build_paths.h"
#include "loom/testing/run.h"
#include "loom/train/row_ledger.h"

namespace elastic_faults {
namespace fs = std::filesystem;
using loom::testing::loom_bin;
using loom::testing::read_jsonl;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

std::string src(const std::string& rel) { return std::string(loom::kSourceDir) + "/" + rel; }

// A debug model at seq 64, 3 rows per rank per micro-batch (a global batch of 12 rows that 4, 3
// and 2 ranks all divide), gradients clipped at 0.5 (the debug model's norms are above it).
std::string train_args(const fs::path& dump, int steps, const std::string& extra = "") {
  return " train --config " + src("configs/llama3_debug.toml") + " --validation.enable=false" +
         " --model.tokenizer_path=" + src("data/default/tokenizer.json") +
         " --training.dataset_path=" + src("data/default/corpus.jsonl") +
         " --job.dump_folder=" + dump.string() + " --training.seq_len=64 --training.local_batch_size=3" +
         " --training.steps=" + std::to_string(steps) + " --training.max_norm=0.5" +
         " --lr_scheduler.warmup_steps=2 --metrics.log_freq=1 --metrics.peak_flops=1e11"
         " --comm.timeout_seconds=120" + extra;
}

struct StepRecord {
  double loss = 0;
  double grad_norm = 0;
};

// The run's final record per step: a "resume" marker supersedes the steps logged after it.
std::map<int64_t, StepRecord> final_steps(const fs::path& dump) {
  std::map<int64_t, StepRecord> steps;
  for (const auto& row : read_jsonl(dump / "metrics.jsonl")) {
    if (row.contains("event")) {
      if (row["event"] == "resume") {
        const int64_t from = row["step"].get<int64_t>();
        steps.erase(steps.upper_bound(from), steps.end());
      }
      continue;
    }
    if (row.contains("loss")) steps[row["step"].get<int64_t>()] = {row["loss"].get<double>(), row["grad_norm"].get<double>()};
  }
  return steps;
}

void expect_same_model(const fs::path& run, const fs::path& reference, int steps) {
  const auto a = final_steps(run), b = final_steps(reference);
  ASSERT_EQ(a.size(), static_cast<size_t>(steps));
  ASSERT_EQ(b.size(), static_cast<size_t>(steps));
  int clipped = 0;
  for (int s = 1; s <= steps; ++s) {
    EXPECT_NEAR(a.at(s).loss, b.at(s).loss, 1e-5 * std::abs(b.at(s).loss)) << "step " << s;
    EXPECT_NEAR(a.at(s).grad_norm, b.at(s).grad_norm, 1e-5 * std::abs(b.at(s).grad_norm)) << "step " << s;
    clipped += b.at(s).grad_norm > 0.5 ? 1 : 0;
  }
  EXPECT_GT(clipped, steps / 2) << "clipping must engage for the norms to matter";
}

// member -> the pids it trained under, from the membership events (trainers and their pids).
std::map<int64_t, std::set<int64_t>> member_pids(const fs::path& dump) {
  std::map<int64_t, std::set<int64_t>> pids;
  for (const auto& row : read_jsonl(dump / "metrics.jsonl")) {
    if (!row.contains("event") || row["event"] != "membership") continue;
    const auto trainers = row["trainers"].get<std::vector<int64_t>>();
    const auto p = row["pids"].get<std::vector<int64_t>>();
    for (size_t i = 0; i < trainers.size(); ++i) pids[trainers[i]].insert(p.at(i));
  }
  return pids;
}

RunResult reference_run(const fs::path& dump, int nproc, int steps, const std::string& extra = "") {
  return run(loom_bin() + " launch --nproc " + std::to_string(nproc) + " --" + train_args(dump, steps, extra));
}

TEST(Elastic, FsdpOfFourLosesARankMidStepContinuesOnThreeAndTakesItsReplacementBack) {
  TempDir ref("elastic_ref"), dir("elastic_fsdp");
  const int steps = 20;
  RunResult reference = reference_run(ref.path(), 4, steps);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  RunResult r = run("env LOOM_FAULT_KILL_MID_STEP=1:5 " + loom_bin() + " launch --nproc 4 --max-restarts 1 --" +
                    train_args(dir.path(), steps, " --fault_tolerance.enable=true"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9"), std::string::npos) << r.output;
  // The survivors kept their processes through every membership; the lost member never came back;
  // the replacement (member 4) trained.
  const auto pids = member_pids(dir.path());
  for (int m : {0, 2, 3}) {
    ASSERT_TRUE(pids.count(m)) << r.output;
    EXPECT_EQ(pids.at(m).size(), 1u) << "member " << m << " was restarted\n" << r.output;
  }
  EXPECT_TRUE(pids.count(4)) << r.output;
  std::vector<std::vector<int64_t>> trainers;
  for (const auto& row : read_jsonl(dir.path() / "metrics.jsonl")) {
    if (row.contains("event") && row["event"] == "membership") trainers.push_back(row["trainers"].get<std::vector<int64_t>>());
  }
  EXPECT_EQ(trainers, (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {0, 2, 3}, {0, 2, 3, 4}}));
  // No applied step is lost: the survivors continue from step 4, the last one applied before the
  // kill inside step 5 (whose rows are issued again).
  EXPECT_NE(r.output.find("state of step 4 re-sharded over 3 rank(s)"), std::string::npos) << r.output;
  expect_same_model(dir.path(), ref.path(), steps);
  const loom::train::RowLedger ledger = loom::train::check_row_ledger(dir.path());
  EXPECT_TRUE(ledger.ok()) << ledger.problem;
  EXPECT_EQ(ledger.steps, steps);
  EXPECT_EQ(ledger.rows, steps * 12);
  EXPECT_EQ(ledger.memberships, 3);
}

}  // namespace elastic_faults
