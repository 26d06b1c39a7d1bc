// Elastic training (issue 48, docs/fault_tolerance.md): a job under `loom launch` with
// fault_tolerance.enable loses a rank, keeps going on the survivors -- same processes, re-sharded
// from their memory -- takes a replacement back at a step boundary, and trains the same model as a
// run that never failed: losses and gradient norms (clipping engaged) step by step, and every row
// exactly once by the rows ledger.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <regex>
#include <memory>
#include <set>

#include "loom/core/build_paths.h"
#include "loom/testing/run.h"
#include "loom/train/row_ledger.h"
#include "debug_run.h"

namespace elastic_faults {
namespace fs = std::filesystem;
using loom::testing::loom_bin;
using loom::testing::read_jsonl;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

// A debug model at seq 64, 3 rows per rank per micro-batch (a global batch of 12 rows that 4, 3
// and 2 ranks all divide), gradients clipped at 0.5 (the debug model's norms are above it).
std::string train_args(const fs::path& dump, int steps, const std::string& extra = "") {
  return loom::faults::debug_train_args(dump, steps, 3, " --training.max_norm=0.5" + extra);
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

// The run that never failed for a layout (`extra`), once per test binary.
const fs::path& reference(const std::string& extra, int steps = 20) {
  static std::map<std::string, std::unique_ptr<TempDir>> runs;
  auto& dir = runs[extra + "/" + std::to_string(steps)];
  if (!dir) {
    dir = std::make_unique<TempDir>("elastic_ref");
    RunResult r = reference_run(dir->path(), 4, steps, extra);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  return dir->path();
}

std::vector<std::vector<int64_t>> trainers_by_membership(const fs::path& dump) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& row : read_jsonl(dump / "metrics.jsonl")) {
    if (row.contains("event") && row["event"] == "membership") out.push_back(row["trainers"].get<std::vector<int64_t>>());
  }
  return out;
}

// An elastic run of `extra`'s layout over 4 ranks with `faults` (env assignments).
RunResult elastic_run(const fs::path& dump, const std::string& faults, int max_restarts, const std::string& extra,
                      int steps = 20) {
  return run("env " + faults + " " + loom_bin() + " launch --nproc 4 --max-restarts " + std::to_string(max_restarts) +
             " --" + train_args(dump, steps, " --fault_tolerance.enable=true" + extra));
}

void expect_every_row_once(const fs::path& dump, int steps, int rows_per_step = 12) {
  const loom::train::RowLedger ledger = loom::train::check_row_ledger(dump);
  EXPECT_TRUE(ledger.ok()) << ledger.problem;
  EXPECT_EQ(ledger.steps, steps);
  EXPECT_EQ(ledger.rows, steps * rows_per_step);
}

// The run trained the reference's model on every row exactly once.
void expect_trains_like(const fs::path& dump, const fs::path& ref, int rows_per_step = 12) {
  expect_same_model(dump, ref, 20);
  expect_every_row_once(dump, 20, rows_per_step);
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

// The same with the copies of the FSDP shards kept by the neighbouring rank (what a job across hosts
// needs: a host copy dies with its host) instead of in each rank's host memory.
TEST(Elastic, FsdpWithNeighbourCopiesLosesARankAndComesBack) {
  const fs::path& ref = reference("");
  TempDir dir("elastic_neighbour");
  RunResult r = elastic_run(dir.path(), "LOOM_FAULT_KILL_MID_STEP=2:8", 1, " --fault_tolerance.shard_copy=neighbour");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("state of step 7 re-sharded over 3 rank(s)"), std::string::npos) << r.output;
  EXPECT_EQ(trainers_by_membership(dir.path()),
            (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {0, 1, 3}, {0, 1, 3, 4}}));
  expect_trains_like(dir.path(), ref);
}

// HSDP 2 x 2 loses a rank: its replica is gone, the other replica holds every shard; the three
// survivors continue as FSDP over 3, and the replacement brings back HSDP 2 x 2.
TEST(Elastic, HsdpTwoByTwoLosesAReplicaAndComesBack) {
  const std::string layout = " --parallelism.data_parallel_replicate_degree=2 --parallelism.data_parallel_shard_degree=2";
  const fs::path& ref = reference(layout);
  TempDir dir("elastic_hsdp");
  RunResult r = elastic_run(dir.path(), "LOOM_FAULT_KILL_MID_STEP=2:5", 1, layout);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(trainers_by_membership(dir.path()),
            (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {0, 1, 3}, {0, 1, 3, 4}}));
  EXPECT_NE(r.output.find("3 rank(s) training (dp_replicate 1 x dp_shard 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("4 rank(s) training (dp_replicate 2 x dp_shard 2"), std::string::npos) << r.output;
  expect_trains_like(dir.path(), ref);
}

// DDP over 4: every rank holds the whole state.
TEST(Elastic, DdpLosesARankAndComesBack) {
  const std::string layout = " --parallelism.data_parallel_replicate_degree=4 --parallelism.data_parallel_shard_degree=1";
  const fs::path& ref = reference(layout);
  TempDir dir("elastic_ddp");
  RunResult r = elastic_run(dir.path(), "LOOM_FAULT_KILL_MID_STEP=3:7", 1, layout);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(trainers_by_membership(dir.path()),
            (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {0, 1, 2}, {0, 1, 2, 4}}));
  expect_trains_like(dir.path(), ref);
}

// FSDP 2 x TP 2 loses a tensor-parallel rank: its whole replica leaves training (its TP partner
// waits), the other replica continues with the lost FSDP shard from its neighbour copy, and the
// replacement and the waiting partner form a replica again.
TEST(Elastic, FsdpTimesTpLosesATensorParallelRankTheOtherReplicaContinues) {
  const std::string layout = " --parallelism.data_parallel_shard_degree=2 --parallelism.tensor_parallel_degree=2";
  const fs::path& ref = reference(layout);
  TempDir dir("elastic_tp");
  RunResult r = elastic_run(dir.path(), "LOOM_FAULT_KILL_MID_STEP=1:5", 1, layout);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(trainers_by_membership(dir.path()),
            (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {2, 3}, {2, 3, 0, 4}}));
  // 6 rows a step (3 per replica) on one replica of 2 TP ranks: 2 micro-batches of 3.
  EXPECT_NE(r.output.find("2 rank(s) training (dp_replicate 1 x dp_shard 1, 3 row(s) per micro-batch), 1 waiting"),
            std::string::npos) << r.output;
  expect_trains_like(dir.path(), ref, 6);
}

// Two ranks at once, not neighbours: each one's shard is in the other survivors' copies.
TEST(Elastic, TwoRanksLostAtOnceAndBothReplaced) {
  const fs::path& ref = reference("");
  TempDir dir("elastic_two");
  RunResult r = elastic_run(dir.path(), "LOOM_FAULT_KILL_MID_STEP=1:5,3:5", 2, "");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto trainers = trainers_by_membership(dir.path());
  ASSERT_GE(trainers.size(), 3u);
  EXPECT_EQ(trainers[1], (std::vector<int64_t>{0, 2})) << r.output;
  EXPECT_EQ(trainers.back().size(), 4u) << r.output;
  expect_trains_like(dir.path(), ref);
}

// Neighbour copies, two neighbours at once: rank 2 held rank 1's copy, so rank 1's shard is gone
// (as when a host with both dies). One line says so, and every rank restarts from the newest
// checkpoint (today's recovery), which is complete. (With host copies the same two deaths are
// survived in place: the copies outlive the processes.)
TEST(Elastic, NeighboursLostTogetherFallBackToTheCheckpointInOneLine) {
  const fs::path& ref = reference("");
  TempDir dir("elastic_neighbours");
  RunResult r = elastic_run(dir.path(), "LOOM_FAULT_KILL_MID_STEP=1:5,2:5", 3,
                            " --fault_tolerance.shard_copy=neighbour --checkpoint.enable=true --checkpoint.interval=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("no surviving copy holds all of"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("every rank restarts from the newest checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("loom launch: restart"), std::string::npos) << r.output;
  expect_trains_like(dir.path(), ref);
}

// Tensor parallel with no data parallelism: the lost rank's TP shard has no other holder. One line
// says so and every rank restarts from the newest checkpoint, without waiting for a replacement.
TEST(Elastic, TensorParallelWithoutDataParallelFallsBackToTheCheckpointInOneLine) {
  const std::string layout = " --parallelism.tensor_parallel_degree=4 --parallelism.data_parallel_shard_degree=1";
  const fs::path& ref = reference(layout);
  TempDir dir("elastic_tp_only");
  RunResult r = elastic_run(dir.path(), "LOOM_FAULT_KILL_MID_STEP=1:5", 2,
                            layout + " --checkpoint.enable=true --checkpoint.interval=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("lost a rank of the only replica"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("no data-parallel replica holds its state; every rank restarts from the newest checkpoint"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("loom launch: restart"), std::string::npos) << r.output;
  expect_trains_like(dir.path(), ref, 3);
}

// The replacement dies while the membership it joins forms: the survivors drop it and form again
// (their state still the one they stopped with), and the next replacement joins.
TEST(Elastic, TheReplacementDiesWhileJoining) {
  const fs::path& ref = reference("");
  TempDir dir("elastic_regrow");
  RunResult r = elastic_run(dir.path(), "LOOM_FAULT_KILL_MID_STEP=1:5 LOOM_FAULT_KILL_FORMING=4", 2, "");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("LOOM_FAULT_KILL_FORMING: member 4"), std::string::npos) << r.output;
  const auto pids = member_pids(dir.path());
  for (int m : {0, 2, 3}) EXPECT_EQ(pids.at(m).size(), 1u) << "member " << m << " was restarted";
  EXPECT_EQ(trainers_by_membership(dir.path()).back(), (std::vector<int64_t>{0, 2, 3, 5})) << r.output;
  expect_trains_like(dir.path(), ref);
}

// A rank dies right after a step whose checkpoint is being written in the background: the save is
// either completed or left in its temporary folder (never half a checkpoint passed off as whole),
// and the run's later checkpoints are complete and resume.
TEST(Elastic, ARankLostDuringACheckpointSaveLeavesNoInconsistentCheckpoint) {
  const fs::path& ref = reference("");
  TempDir dir("elastic_save");
  RunResult r = elastic_run(dir.path(), "LOOM_FAULT_KILL=1:6", 1,
                            " --checkpoint.enable=true --checkpoint.interval=3 --checkpoint.async_mode=async");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_trains_like(dir.path(), ref);
  for (const auto& e : fs::directory_iterator(dir.path() / "checkpoint")) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.find('.') != std::string::npos) continue;
    // Saves go to a temporary folder renamed when whole: a step-N folder is a complete checkpoint.
    EXPECT_TRUE(fs::exists(e.path() / "COMPLETE")) << e.path();
  }
  EXPECT_TRUE(fs::exists(dir.path() / "checkpoint" / "step-20" / "COMPLETE"));
  // The newest complete checkpoint resumes (one rank, any layout reads it).
  RunResult resumed = run(loom_bin() + train_args(dir.path(), 21, " --checkpoint.enable=true"));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
}

}  // namespace elastic_faults
