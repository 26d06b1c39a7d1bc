// The fault suite (ctest label "faults"): what a careful user does wrong and what goes wrong under a
// real job — divergence, a rank that throws, a rank killed without checkpoints, two runs in one
// folder, a blocked checkpoint folder, leftovers that must not block a resume — each asserted on
// exit codes, the one-line messages a person reads, and what is left on disk. Every case drives the
// `loom` binary as a user would (a debug model at seq 64, a few seconds a run).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/build_paths.h"
#include "loom/data/tokenizer.h"
#include "loom/models/common/model_dir.h"
#include "loom/models/llama3/model.h"
#include "loom/testing/checkpoint_files.h"
#include "loom/testing/run.h"
#include "debug_run.h"

namespace {
namespace fs = std::filesystem;
using loom::testing::count_occurrences;
using loom::testing::expect_identical_checkpoint_files;
using loom::testing::file_bytes;
using loom::testing::loom_bin;
using loom::testing::read_jsonl;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

using loom::faults::src;

// `train ...` for a small FSDP/single-process debug run in `dump` (seq 64, batch 2 per rank).
std::string train_args(const fs::path& dump, int steps, const std::string& extra = "") {
  return loom::faults::debug_train_args(dump, steps, 2, extra);
}
std::string train_args(const TempDir& dir, int steps, const std::string& extra = "") {
  return train_args(dir.path(), steps, extra);
}

std::string launch(int nproc, const std::string& flags = "") {
  return loom_bin() + " launch --nproc " + std::to_string(nproc) + flags + " --";
}

std::vector<int64_t> checkpoint_steps(const fs::path& folder) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0 && name.find('.') == std::string::npos &&
        fs::exists(e.path() / "COMPLETE", ec)) {
      steps.push_back(std::stoll(name.substr(5)));
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Every floating-point tensor of every rank file of a checkpoint is finite.
void expect_all_finite(const fs::path& dir) {
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    ++files;
    loom::checkpoint::SafetensorsFile f(e.path());
    for (const auto& name : f.names()) {
      const torch::Tensor t = f.tensor(name);
      if (t.is_floating_point()) EXPECT_TRUE(torch::isfinite(t).all().item<bool>()) << dir << " " << name;
    }
  }
  EXPECT_GT(files, 0) << dir;
}

}  // namespace

// Issue 8, item 1: lr 1e3 diverges. Before: NaN from step 7, exit 0, a checkpoint full of NaN, and
// pruning deleted the good ones. Now: exit 3 naming the step, nothing non-finite saved, the good
// checkpoints kept.
TEST(Faults, DivergenceStopsBeforeAnyNonFiniteCheckpoint) {
  TempDir dir("diverge");
  RunResult r = run(loom_bin() + train_args(dir, 20, " --optimizer.lr=1e3 --checkpoint.enable=true"
                                                     " --checkpoint.interval=5 --checkpoint.keep_latest_k=2"
                                                     " --parallelism.data_parallel_shard_degree=1"));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  std::smatch m;
  const std::regex line("error: training diverged: non-finite (loss|gradient norm)[^\\n]* at step (\\d+)");
  ASSERT_TRUE(std::regex_search(r.output, m, line)) << r.output;
  const int64_t bad_step = std::stoll(m[2]);
  EXPECT_NE(r.output.find("first non-finite gradient: "), std::string::npos) << r.output;
  const auto steps = checkpoint_steps(dir.path() / "checkpoint");
  ASSERT_FALSE(steps.empty()) << "the good checkpoints were lost\n" << r.output;
  EXPECT_EQ(steps.back(), (bad_step - 1) / 5 * 5);  // the last interval save before the bad step
  for (int64_t s : steps) expect_all_finite(dir.path() / "checkpoint" / ("step-" + std::to_string(s)));
  std::printf("lr 1e3: diverged at step %lld; checkpoints kept:", static_cast<long long>(bad_step));
  for (int64_t s : steps) std::printf(" step-%lld", static_cast<long long>(s));
  std::printf("\n");
}

// The guard on 2 FSDP ranks with a NaN injected on one rank at step 7: both ranks stop (exit 3),
// `loom launch` does not restart a divergence, and the newest checkpoint (step 4) is bitwise the
// one the same run writes when nothing goes wrong.
TEST(Faults, DivergenceOnOneRankStopsEveryRankAndKeepsTheLastFiniteCheckpointBitwise) {
  TempDir bad("nan"), clean("clean");
  const std::string ckpt = " --checkpoint.enable=true --checkpoint.interval=4 --training.deterministic=true";
  RunResult r = run("env LOOM_FAULT_NAN=1:7 " + launch(2, " --max-restarts 2") +
                    train_args(bad, 12, ckpt + " --checkpoint.keep_latest_k=2"));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("training diverged: non-finite loss nan and gradient norm nan at step 7"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not restarted"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("loom launch: restart"), std::string::npos) << r.output;
  EXPECT_EQ(checkpoint_steps(bad.path() / "checkpoint"), (std::vector<int64_t>{4}));
  RunResult ref = run(launch(2) + train_args(clean, 12, ckpt + " --checkpoint.keep_latest_k=0"));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  expect_identical_checkpoint_files(bad.path() / "checkpoint" / "step-4",
                                    clean.path() / "checkpoint" / "step-4",
                                    {"rank-0.safetensors", "rank-1.safetensors"});
}

// training.skip_nonfinite_steps: the NaN step is skipped with a warning and the run completes.
TEST(Faults, SkipNonfiniteStepsSkipsAndFinishes) {
  TempDir dir("skip");
  RunResult r = run("env LOOM_FAULT_NAN=0:3 " + loom_bin() +
                    train_args(dir, 6, " --training.skip_nonfinite_steps=1"
                                       " --parallelism.data_parallel_shard_degree=1"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("non-finite loss nan and gradient norm nan at step 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step skipped (1 of 1 allowed"), std::string::npos) << r.output;
  // Non-finite config values are refused before anything runs.
  RunResult inf = run(loom_bin() + train_args(dir, 6, " --optimizer.lr=inf"));
  EXPECT_EQ(inf.exit_code, 2) << inf.output;
}

// training.step_readback = "log_steps" (the GPU default): the non-finite guard runs on the device,
// inside the fused update, and the host learns of the NaN step at the next log step (10 here). The
// run still stops with exit 3 naming step 7; its update was never applied, so the checkpoint
// written after it (step 8) holds finite weights: resuming from it with the every-step guard (which
// would stop at a non-finite loss) trains on with finite losses.
TEST(Faults, DeviceSideGuardStopsADivergedRunWithFiniteCheckpoints) {
  TempDir bad("nan_dev");
  const std::string args = " --checkpoint.enable=true --checkpoint.interval=4 --checkpoint.keep_latest_k=0"
                           " --training.deterministic=true --metrics.log_freq=5 --training.step_readback=log_steps";
  RunResult r = run("env LOOM_FAULT_NAN=1:7 " + launch(2) + train_args(bad, 12, args));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("training diverged: non-finite loss nan and gradient norm nan at step 7 (found at "
                          "step 10's read-back"),
            std::string::npos) << r.output;
  EXPECT_EQ(checkpoint_steps(bad.path() / "checkpoint"), (std::vector<int64_t>{4, 8}));
  RunResult resumed = run(launch(2) + train_args(bad, 10, args + " --training.step_readback=every_step"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const std::vector<double> after = loom::testing::logged_losses(bad.path());
  ASSERT_FALSE(after.empty());
  for (double loss : after) EXPECT_TRUE(std::isfinite(loss)) << resumed.output;
}

// The same guard with training.skip_nonfinite_steps: the NaN step is skipped on the device, the
// warning comes at the next log step, and the run completes.
TEST(Faults, DeviceSideGuardSkipsAllowedNonfiniteSteps) {
  TempDir dir("skip_dev");
  RunResult r = run("env LOOM_FAULT_NAN=0:3 " + loom_bin() +
                    train_args(dir, 6, " --training.skip_nonfinite_steps=1 --metrics.log_freq=5"
                                       " --training.step_readback=log_steps"
                                       " --parallelism.data_parallel_shard_degree=1"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("non-finite loss nan and gradient norm nan at step 3 (found at step 5's read-back"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the device skipped its update (1 of 1 allowed"), std::string::npos) << r.output;
  // Muon has no device-side guard: "log_steps" with it is refused before training.
  RunResult muon = run(loom_bin() + train_args(dir, 6, " --optimizer.name=Muon --training.step_readback=log_steps"));
  EXPECT_EQ(muon.exit_code, 2) << muon.output;
  EXPECT_NE(muon.output.find("training.step_readback"), std::string::npos) << muon.output;
}

// Issue 8, item 2: one rank throws. Before: both ranks sat in the shutdown barrier until the
// 300 s watchdog, exit 124, the error never shown. Now: the rank's own line, the launcher naming
// it, and the job over in seconds, on 2 and on 4 ranks.
TEST(Faults, ThrowingRankEndsTheJobPromptlyWithItsOwnError) {
  for (int nproc : {2, 4}) {
    TempDir dir("throw");
    const int bad = nproc - 1;
    RunResult r = run("env LOOM_FAULT_THROW=" + std::to_string(bad) + ":2 " + launch(nproc) +
                      train_args(dir, 50, " --comm.timeout_seconds=300"), 120);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    const std::string own = "[rank" + std::to_string(bad) + "] error: LOOM_FAULT_THROW: injected failure on rank " +
                            std::to_string(bad) + " after step 2";
    EXPECT_NE(r.output.find(own), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("error: rank " + std::to_string(bad) + " (local rank " + std::to_string(bad)),
              std::string::npos) << r.output;
    EXPECT_NE(r.output.find("exited with code 1: " + own), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("watchdog"), std::string::npos) << r.output;
    EXPECT_LT(r.seconds, 30.0) << r.output;  // start-up + 2 steps; a hang would take 300 s
    std::printf("%d ranks: a throwing rank ended the job in %.1f s (exit %d)\n", nproc, r.seconds, r.exit_code);
  }
}

// Without `loom launch` (torchrun, srun, mpirun start ranks that nobody stops): the failing rank
// tells the others through the rendezvous store, and they stop with exit code 4, naming it.
TEST(Faults, PeersStopOnTheirOwnWithoutALauncher) {
  TempDir dir("peer");
  const int port = 20000 + static_cast<int>(getpid() % 20000);
  const std::string env = "env WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                          std::to_string(port) + " LOOM_FAULT_THROW=1:2 ";
  const std::string args = train_args(dir, 200, " --comm.timeout_seconds=300");
  const std::string script = "(" + env + "RANK=0 LOCAL_RANK=0 " + loom_bin() + args + "; echo rank0-exit=$?) & (" +
                             env + "RANK=1 LOCAL_RANK=1 " + loom_bin() + args + "; echo rank1-exit=$?) & wait";
  RunResult r = run("bash -c '" + script + "'", 120);
  EXPECT_NE(r.output.find("rank1-exit=1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank0-exit=4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank0] error: stopping: rank 1: LOOM_FAULT_THROW"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 30.0) << r.output;
}

// Issue 8, items 2 and 5: a token id >= the vocabulary in a token file, trained on 2 ranks with
// restarts allowed. Before: "index out of range in self" from the embedding, naming nothing, then a
// 300 s hang in the shutdown barrier, three times. Now: found at load, naming the file and the
// position, on every rank's console, exit 2 without restarts, in seconds.
TEST(Faults, OutOfRangeTokenIdIsNamedAtLoadAndEndsTheJob) {
  TempDir dir("badtokens");
  // A token file (format in data/sources.h) whose header claims the model's 2048-id vocabulary but
  // whose second document holds id 3000.
  const fs::path tokens = dir.path() / "bad.tokens";
  {
    std::ofstream out(tokens, std::ios::binary);
    auto u32 = [&](uint32_t v) { out.write(reinterpret_cast<const char*>(&v), 4); };
    auto i64 = [&](int64_t v) { out.write(reinterpret_cast<const char*>(&v), 8); };
    std::vector<uint16_t> ids;
    for (int d = 0; d < 200; ++d) {
      for (int t = 0; t < 40; ++t) ids.push_back(static_cast<uint16_t>(10 + (d * 7 + t) % 1000));
      ids.push_back(2046);  // EOS of the default tokenizer
    }
    ids[41 + 5] = 3000;  // document 1, offset 5
    out.write("LOOMTOK", 8);
    u32(1);
    u32(2);
    i64(static_cast<int64_t>(ids.size()));
    i64(200);
    i64(2048);
    i64(2045);  // BOS of the default tokenizer
    i64(2046);  // EOS
    i64(0);
    out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 2));
  }
  RunResult r = run(launch(2, " --max-restarts 2") +
                    train_args(dir, 20, " --training.dataset_path=" + tokens.string() +
                                        " --training.dataset_format=tokens --comm.timeout_seconds=300"), 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  // Every rank reads the same file and fails the same way; whichever reports first is quoted (the
  // launcher stops the other, which may not get to print its own line).
  EXPECT_NE(r.output.find("] error: token file '" + tokens.string() + "' has token id 3000 at document 1, offset 5"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("loom launch: restart"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("index out of range"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0) << r.output;
  std::printf("token id 3000 >= vocab 2048 on 2 ranks: exit %d after %.1f s\n", r.exit_code, r.seconds);
}

// Issue 8, item 6: a configuration error is not retried (before: 4 attempts x 2 ranks = 8
// identical lines, exit 1); the launch exits 2 like the README says.
// Issue 46 (9): a /dev/shm without room for a collective (rank 1 limited to 1 MiB of segment) moves
// that group to Gloo on every rank at the same collective instead of ending the job at it; the
// run trains the same losses and gradient norms as one with room (the fallback sums in rank order).
TEST(Faults, SharedMemoryWithoutRoomMidRunFallsBackToGlooAndTrainsTheSameModel) {
  TempDir limited("shm_full"), roomy("shm_roomy");
  const std::string flags = " --training.deterministic=true";
  const RunResult r = run("env LOOM_FAULT_SHM_LIMIT=1048576@1 " + launch(2) + train_args(limited, 3, flags));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("continue on Gloo from this one on"), std::string::npos) << r.output;
  const RunResult ref = run(launch(2) + train_args(roomy, 3, flags));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  EXPECT_EQ(ref.output.find("continue on Gloo"), std::string::npos) << ref.output;
  EXPECT_EQ(loom::testing::logged_losses(limited.path()), loom::testing::logged_losses(roomy.path()));
  EXPECT_EQ(loom::testing::logged_grad_norms(limited.path()), loom::testing::logged_grad_norms(roomy.path()));
}

TEST(Faults, ConfigErrorsAreNotRestarted) {
  TempDir dir("usage");
  RunResult r = run(launch(2, " --max-restarts 3") + train_args(dir, 4, " --optimizer.lr=-1"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output.find("loom launch: restart"), std::string::npos) << r.output;
  // Issue 22, item 11: one line, the launcher's, quoting the rank that reported it (the ranks stay
  // quiet about a usage error the launcher prints): no longer 8, nor 3, identical lines.
  EXPECT_EQ(count_occurrences(r.output, "'optimizer.lr' must be >= 0"), 1) << r.output;
  EXPECT_NE(r.output.find("not restarted: a configuration or usage error"), std::string::npos) << r.output;
  // Found before rendezvous, yet the line names the rank.
  EXPECT_TRUE(std::regex_search(r.output, std::regex("\\[rank[01]\\] error: config key 'optimizer.lr'")))
      << r.output;
  // A missing file cannot appear by restarting either.
  RunResult missing = run(launch(2, " --max-restarts 3") + " train --config /nonexistent.toml");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_EQ(missing.output.find("loom launch: restart"), std::string::npos) << missing.output;
  // Options for the ranks given without '--' get a hint instead of a parser message.
  RunResult dashes = run(loom_bin() + " launch --nproc 2 train --config x.toml");
  EXPECT_EQ(dashes.exit_code, 2) << dashes.output;
  EXPECT_NE(dashes.output.find("put the ranks' command after '--'"), std::string::npos) << dashes.output;
}

// Issue 8, item 6: a rank killed with restarts allowed but checkpointing off. Before: restarted
// from step 1 without a word. Now: warned at start and at the restart; the restart still works.
TEST(Faults, RestartWithoutCheckpointsSaysItStartsOver) {
  TempDir dir("nockpt");
  RunResult r = run("env LOOM_FAULT_KILL=1:2 " + launch(2, " --max-restarts 1") + train_args(dir, 4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--max-restarts 1 without checkpoint.enable"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restart 1 of 1: checkpoint.enable is false, so training starts again from step 1"),
            std::string::npos) << r.output;
}

// Issue 46 (11): the launcher's rank fork server died between attempts (LOOM_FAULT_KILL_FORK_SERVER
// kills it before the restart). Before, the restart failed ("the rank fork server has gone");
// now the ranks are exec'd, as when there is no server, and the run finishes.
TEST(Faults, RestartAfterTheForkServerDiedExecsTheRanks) {
  TempDir dir("forkserver");
  RunResult r = run("env LOOM_FAULT_KILL=1:2 LOOM_FAULT_KILL_FORK_SERVER=1 " + launch(2, " --max-restarts 1") +
                    train_args(dir, 3));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("loom launch: restart 1 of 1"), std::string::npos) << r.output;
  EXPECT_EQ(count_occurrences(r.output, ") has gone; this and every later rank is exec'd"), 1) << r.output;
  EXPECT_EQ(loom::testing::logged_losses(dir.path()).size(), 3u) << r.output;
}

// A throwing rank with restarts and checkpoints: the restart resumes and the metrics say where.
TEST(Faults, ThrowingRankRestartsFromTheCheckpointWithAResumeMarker) {
  TempDir dir("retry");
  RunResult r = run("env LOOM_FAULT_THROW=0:5 " + launch(2, " --max-restarts 1") +
                    train_args(dir, 8, " --checkpoint.enable=true --checkpoint.interval=3"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  const auto rows = read_jsonl(dir.path() / "metrics.jsonl");
  std::vector<int64_t> steps;
  int markers = 0;
  for (const auto& row : rows) {
    if (row.contains("event")) {
      ++markers;
      EXPECT_EQ(row["event"], "resume");
      EXPECT_EQ(row["step"], 3);
      EXPECT_EQ(row["attempt"], 1);
    }
    steps.push_back(row["step"]);
  }
  EXPECT_EQ(markers, 1);
  // Steps 1..5 of the first attempt, the marker at 3, then 4..8 again.
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8}));
}

// Issue 8, item 4: two runs in one folder. Before: both exit 0 with interleaved metrics and mixed
// checkpoints. Now: the second is refused naming the first's pid; a later run moves the old
// metrics aside instead of overwriting them.
TEST(Faults, SecondRunInTheSameFolderIsRefused) {
  TempDir dir("concurrent");
  const fs::path out = dir.path() / "first.log";
  // The first run, in the background for long enough; its pid is the lock holder's.
  const std::string first = loom_bin() + train_args(dir, 100000, " --parallelism.data_parallel_shard_degree=1") +
                            " > " + out.string() + " 2>&1 & echo $!";
  RunResult started = run("bash -c '" + first + "'", 30);
  const pid_t pid = static_cast<pid_t>(std::stol(started.output));
  bool training = false;
  for (int i = 0; i < 600 && !training; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    training = fs::exists(dir.path() / "metrics.jsonl") && fs::file_size(dir.path() / "metrics.jsonl") > 0;
  }
  ASSERT_TRUE(training) << file_bytes(out);
  RunResult second = run(loom_bin() + train_args(dir, 3, " --parallelism.data_parallel_shard_degree=1"));
  kill(pid, SIGKILL);
  EXPECT_EQ(second.exit_code, 2) << second.output;
  EXPECT_NE(second.output.find("is in use by another Loom run (pid " + std::to_string(pid)), std::string::npos)
      << second.output;
  // The lock dies with its holder; the next run keeps the killed run's metrics as metrics.1.jsonl.
  for (int i = 0; i < 100 && kill(pid, 0) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  RunResult third = run(loom_bin() + train_args(dir, 3, " --parallelism.data_parallel_shard_degree=1"));
  ASSERT_EQ(third.exit_code, 0) << third.output;
  EXPECT_TRUE(fs::exists(dir.path() / "metrics.1.jsonl"));
  EXPECT_EQ(read_jsonl(dir.path() / "metrics.jsonl").size(), 3u);
  EXPECT_GT(read_jsonl(dir.path() / "metrics.1.jsonl").size(), 0u);
}

// Issue 8, item 7: a blocked checkpoint folder is found before the first step, not at the first
// save; nothing is trained and the exit code is 2 (not retried).
TEST(Faults, BlockedCheckpointFolderFailsAtStart) {
  TempDir dir("blocked");
  std::ofstream(dir.path() / "checkpoint") << "a file where the checkpoint folder should be\n";
  RunResult r = run(loom_bin() + train_args(dir, 50, " --checkpoint.enable=true --checkpoint.interval=49"
                                                     " --parallelism.data_parallel_shard_degree=1"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the checkpoint folder (job.dump_folder/checkpoint.folder)"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("[step "), std::string::npos) << "trained before failing:\n" << r.output;
}

// Issue 8, item 7: a model-only last save does not block a later resume (the run resumes from the
// newest full checkpoint); a folder with only model-only checkpoints says what to do; resuming
// with training.steps not past the checkpoint is an error, not a silent exit 0.
TEST(Faults, ModelOnlyCheckpointsAndFinishedRuns) {
  TempDir dir("modelonly");
  const std::string ckpt = " --checkpoint.enable=true --checkpoint.interval=3 --checkpoint.model_only=true"
                           " --parallelism.data_parallel_shard_degree=1";
  ASSERT_EQ(run(loom_bin() + train_args(dir, 6, ckpt)).exit_code, 0);
  RunResult more = run(loom_bin() + train_args(dir, 8, ckpt));
  ASSERT_EQ(more.exit_code, 0) << more.output;
  EXPECT_NE(more.output.find("holds model weights only; resuming from an earlier full checkpoint"),
            std::string::npos) << more.output;
  EXPECT_NE(more.output.find("at step 3"), std::string::npos) << more.output;

  TempDir only("onlymodel");
  const std::string last_only = " --checkpoint.enable=true --checkpoint.interval=100 --checkpoint.model_only=true"
                                " --parallelism.data_parallel_shard_degree=1";
  ASSERT_EQ(run(loom_bin() + train_args(only, 2, last_only)).exit_code, 0);
  RunResult blocked = run(loom_bin() + train_args(only, 4, last_only));
  EXPECT_EQ(blocked.exit_code, 2) << blocked.output;
  EXPECT_NE(blocked.output.find("holds only model-only checkpoints"), std::string::npos) << blocked.output;
  EXPECT_EQ(blocked.output.find("ShardedStateDict"), std::string::npos) << blocked.output;

  TempDir done("done");
  const std::string full = " --checkpoint.enable=true --checkpoint.interval=3 --parallelism.data_parallel_shard_degree=1";
  ASSERT_EQ(run(loom_bin() + train_args(done, 3, full)).exit_code, 0);
  RunResult again = run(loom_bin() + train_args(done, 3, full));
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_NE(again.output.find("nothing left to train; raise training.steps"), std::string::npos) << again.output;
}

// Issue 22, items 7, 8 and 11: `loom generate`, `score` and `convert` on a tiny Llama checkpoint
// written in-process (a second or less a command).
namespace test_faults {

// A Llama small enough to load in a blink: max_seq_len 32, vocabulary `vocab`.
std::shared_ptr<loom::llama3::Transformer> tiny_llama(uint64_t seed, int64_t vocab = 97) {
  loom::llama3::ModelArgs a;
  a.dim = 32, a.n_layers = 1, a.n_heads = 4, a.n_kv_heads = 2, a.vocab_size = vocab;
  a.multiple_of = 16, a.max_seq_len = 32, a.rope_theta = 10000.0;
  auto model = std::make_shared<loom::llama3::Transformer>(a, torch::TensorOptions().device(torch::kMeta));
  model->to_empty(torch::kCPU);
  model->init_weights(seed);
  return model;
}

// `dir` as a model-only Loom checkpoint of tiny_llama(seed).
fs::path tiny_checkpoint(const fs::path& dir, uint64_t seed = 1) {
  loom::models::save_loom_checkpoint(loom::models::get_spec("llama3"), *tiny_llama(seed), dir);
  return dir;
}

// Flips one byte in the middle of `file`: its size stays, so only a CRC-32C check can tell.
void flip_byte_in_middle(const fs::path& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  const auto size = static_cast<std::streamoff>(fs::file_size(file));
  f.seekg(size - size / 4);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(size - size / 4);
  f.write(&c, 1);
}

RunResult generate(const std::string& checkpoint, const std::string& flags) {
  return run(loom_bin() + " generate --checkpoint " + checkpoint + " " + flags, 60);
}

}  // namespace test_faults

// Item 7: what does not fit the model is refused in one line (exit 2) before the model is built:
// a prompt longer than max_seq_len, prompt + new tokens past it (also 1e9 new tokens, which
// allocated 128 GB, and INT64_MAX, which overflowed), NaN top-p, a negative seed.
TEST(Faults, GenerateRefusesWhatDoesNotFitTheModelBeforeLoading) {
  TempDir dir("gen-limits");
  const std::string ckpt = test_faults::tiny_checkpoint(dir.path() / "model").string();
  std::string long_prompt = "1";
  for (int i = 0; i < 39; ++i) long_prompt += ",1";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"--prompt-tokens " + long_prompt, {"the prompt has 40 tokens", "maximum sequence length is 32", "shorten the prompt"}},
      {"--prompt-tokens 1,2,3 --max-new-tokens 30", {"plus --max-new-tokens 30", "lower --max-new-tokens to at most 29"}},
      {"--prompt-tokens 1,2,3 --max-new-tokens 1000000000", {"--max-new-tokens 1000000000", "at most 29"}},
      {"--prompt-tokens 1,2,3 --max-new-tokens 9223372036854775807", {"--max-new-tokens 9223372036854775807", "at most 29"}},
      {"--prompt-tokens 1,2,3 --top-p nan", {"--top-p must be in (0, 1]", "got nan"}},
      {"--prompt-tokens 1,2,3 --seed -1", {"--seed must be a non-negative integer, got -1"}},
      // Issue 46 (11): an empty --prompt-tokens asked for a tokenizer instead of saying it is empty.
      {"--prompt-tokens ''", {"--prompt-tokens is empty: give at least one token id"}},
  };
  for (const auto& [flags, parts] : cases) {
    const RunResult r = test_faults::generate(ckpt, flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_EQ(count_occurrences(r.output, "error: "), 1) << r.output;
    for (const auto& part : parts) EXPECT_NE(r.output.find(part), std::string::npos) << flags << "\n" << r.output;
    EXPECT_EQ(r.output.find("allocat"), std::string::npos) << r.output;
    EXPECT_LT(r.seconds, 20) << flags;
  }
  // What fits still runs: 29 new tokens after a 3-token prompt fill the 32 positions exactly.
  const RunResult ok = test_faults::generate(ckpt, "--prompt-tokens 1,2,3 --max-new-tokens 29 --temperature 0 --ids");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("3 prompt + 29 new tokens"), std::string::npos) << ok.output;
}

// Item 11: option ranges are checked before anything is loaded (the checkpoint here is an empty
// folder, which would fail to load) and say the range in words, not CLI11's "Value 0 not in range
// 0.000000 to 1797...", nor let NaN through.
TEST(Faults, GenerateOptionRangesAreCheckedFirstInPlainWords) {
  TempDir dir("gen-ranges");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--temperature nan", "--temperature must be a finite number >= 0 (0 = greedy), got nan"},
      {"--temperature -1", "--temperature must be a finite number >= 0 (0 = greedy), got -1"},
      {"--max-new-tokens 0", "--max-new-tokens must be at least 1, got 0"},
      {"--top-k -1", "--top-k must be >= 0 (0 = every token), got -1"},
      {"--top-p 0", "--top-p must be in (0, 1] (1 = every token), got 0"},
      {"--top-p 1.5", "--top-p must be in (0, 1] (1 = every token), got 1.5"},
  };
  for (const auto& [flags, message] : cases) {
    const RunResult r = test_faults::generate(dir.str(), "--prompt-tokens 1,2 " + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("error: " + message + "\n"), std::string::npos) << flags << "\n" << r.output;
    EXPECT_EQ(r.output.find("1797"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("not in range"), std::string::npos) << r.output;
  }
}

// Item 8: a checkpoint folder whose newest step is CRC-corrupt loads its previous complete step
// in generate, score and convert, as a training resume does, with a warning naming the skipped
// step and why. Before: each stopped with exit 1 at the corrupt step.
TEST(Faults, GenerateScoreConvertFallBackPastACorruptNewestStep) {
  TempDir dir("gen-fallback");
  const fs::path folder = dir.path() / "checkpoint";
  test_faults::tiny_checkpoint(folder / "step-1", 1);
  test_faults::tiny_checkpoint(folder / "step-2", 2);
  test_faults::flip_byte_in_middle(folder / "step-2" / "rank-0.safetensors");
  const std::vector<std::string> commands = {
      " generate --checkpoint " + folder.string() + " --prompt-tokens 1,2 --max-new-tokens 2 --ids",
      " score --checkpoint " + folder.string() + " --tokens 1,2,3",
      " convert --to hf --input " + folder.string() + " --output " + (dir.path() / "hf").string(),
  };
  for (const std::string& cmd : commands) {
    const RunResult r = run(loom_bin() + cmd, 60);
    EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("step-2' is unusable: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("CRC-32C"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("falling back to an earlier one"), std::string::npos) << r.output;
    // Nothing but the result on stdout: the loaded step is not announced there.
    EXPECT_EQ(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  }
  const RunResult gen = run(loom_bin() + commands[0], 60);
  EXPECT_NE(gen.output.find("new tokens in"), std::string::npos) << gen.output;
  EXPECT_NE(gen.output.find("from " + (folder / "step-1").string() + "\n"), std::string::npos) << gen.output;
  EXPECT_TRUE(fs::exists(dir.path() / "hf" / "config.json"));
}

// Issue 46 (7): the same fallback for a LoRA run's adapter checkpoints on a referenced base: `loom
// score --adapter <run's checkpoint folder>` whose newest step is CRC-corrupt reads the previous
// complete step, with the warning, and scores as that step does. Before: exit 1 at the corrupt step.
TEST(Faults, AdapterCheckpointFolderFallsBackPastACorruptNewestStep) {
  TempDir base("lora-fallback-base"), run_dir("lora-fallback-run");
  const std::string tiny = " --model.flavor=tiny --parallelism.data_parallel_shard_degree=1";
  RunResult r = run(loom_bin() + train_args(base, 1, tiny + " --checkpoint.enable=true --checkpoint.model_only=true"),
                    120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path base_dir = base.path() / "checkpoint" / "step-1";
  r = run(loom_bin() + train_args(run_dir, 4, tiny + " --lora.rank=4 --lora.target_modules=q_proj,v_proj"
                                               " --checkpoint.enable=true --checkpoint.interval=2"
                                               " --checkpoint.initial_load_path=" + base_dir.string()),
          120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path folder = run_dir.path() / "checkpoint";
  ASSERT_TRUE(fs::exists(folder / "step-2" / "metadata.json"));
  {
    // Every chunk of the newest step corrupt (the adapters are a small part of a file that also
    // holds their optimizer state): one byte in every 64 after the safetensors header.
    const fs::path file = folder / "step-4" / "rank-0.safetensors";
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header = 0;
    f.read(reinterpret_cast<char*>(&header), sizeof(header));
    const auto size = static_cast<std::streamoff>(fs::file_size(file));
    for (std::streamoff at = static_cast<std::streamoff>(8 + header); at < size; at += 64) {
      char c = 0;
      f.seekg(at);
      f.read(&c, 1);
      c = static_cast<char>(c ^ 0x5a);
      f.seekp(at);
      f.write(&c, 1);
    }
  }
  const std::string score = loom_bin() + " score --checkpoint " + base_dir.string() + " --tokens 1,2,3,4 --adapter ";
  const RunResult fallback = run(score + folder.string(), 60), step2 = run(score + (folder / "step-2").string(), 60);
  EXPECT_EQ(fallback.exit_code, 0) << fallback.output;
  EXPECT_NE(fallback.output.find("step-4' is unusable: "), std::string::npos) << fallback.output;
  EXPECT_NE(fallback.output.find("CRC-32C"), std::string::npos) << fallback.output;
  ASSERT_EQ(step2.exit_code, 0) << step2.output;
  // The same scores as the step it fell back to (the lines that carry numbers).
  auto scores = [](const std::string& out) {
    std::string lines;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      if (line.find("loss") != std::string::npos || line.find("nll") != std::string::npos) lines += line + "\n";
    }
    return lines;
  };
  EXPECT_FALSE(scores(step2.output).empty()) << step2.output;
  EXPECT_EQ(scores(fallback.output), scores(step2.output)) << fallback.output << "\n---\n" << step2.output;
}

// Issue 46 (6), the Trainer's side: a Loom checkpoint given as checkpoint.initial_load_path (read by
// each rank for its own pieces, on 2 ranks here) with a NaN in one weight stops before any step,
// exit 2, naming the tensor on every rank, instead of a "divergence" at step 1 that blames the LR.
TEST(Faults, InitialWeightsWithNaNAreRefusedNamingTheTensor) {
  TempDir dir("nan-weights");
  RunResult base = run(loom_bin() + train_args(dir.path() / "base", 1,
                                               " --model.flavor=tiny --parallelism.data_parallel_shard_degree=1"
                                               " --checkpoint.enable=true --checkpoint.model_only=true"),
                       120);
  ASSERT_EQ(base.exit_code, 0) << base.output;
  const auto loaded = loom::models::load_model_dir(dir.path() / "base" / "checkpoint");
  {
    torch::NoGradGuard no_grad;
    loaded.model->parameter("layers.2.attention.wk.weight").view(-1)[3] = std::numeric_limits<float>::quiet_NaN();
  }
  loom::models::save_loom_checkpoint(*loaded.spec, *loaded.model, dir.path() / "weights");
  const RunResult r = run(launch(2) + train_args(dir.path() / "run", 2,
                                                 " --model.flavor=tiny --checkpoint.initial_load_path=" +
                                                     (dir.path() / "weights").string()),
                          120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("holds non-finite weights: tensor 'layers.2.attention.wk.weight'"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("training diverged"), std::string::npos) << r.output;
}

// Issue 46 (8): errors no restart can fix are exit 2, so `loom launch --max-restarts` does not
// retry them: a LoRA run whose base (checkpoint.initial_load_path) was deleted before a resume, and
// a missing initial_load_path. Both were exit 1.
TEST(Faults, DeletedLoraBaseAndMissingInitialWeightsAreExit2) {
  TempDir dir("lora-deleted-base");
  const std::string tiny = " --model.flavor=tiny --parallelism.data_parallel_shard_degree=1";
  RunResult r = run(loom_bin() + train_args(dir.path() / "base", 1, tiny + " --checkpoint.enable=true --checkpoint.model_only=true"),
                    120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string lora = tiny + " --lora.rank=4 --checkpoint.enable=true --checkpoint.interval=2"
                                  " --checkpoint.initial_load_path=" + (dir.path() / "base" / "checkpoint" / "step-1").string();
  r = run(loom_bin() + train_args(dir.path() / "run", 2, lora), 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::remove_all(dir.path() / "base");
  r = run(loom_bin() + train_args(dir.path() / "run", 4, lora), 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("step-1' is not a directory"), std::string::npos) << r.output;
  r = run(loom_bin() + train_args(dir.path() / "fresh", 2, tiny + " --checkpoint.initial_load_path=/nonexistent/weights"),
          120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'/nonexistent/weights' is not a directory"), std::string::npos) << r.output;
}

// Issue 46 (11): an adapter made for another model family is named as such (its targets are the
// adapter's, not this run's lora.target_modules, which the message used to blame).
TEST(Faults, AnAdapterOfAnotherFamilySaysSo) {
  TempDir dir("adapter-other-family");
  const fs::path base = test_faults::tiny_checkpoint(dir.path() / "model", 1);
  const fs::path adapter = dir.path() / "qwen3_moe_adapter";
  fs::create_directories(adapter);
  std::ofstream(adapter / "adapter_config.json")
      << R"({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,)"
      << R"( "target_modules": ["gate", "q_proj"], "bias": "none", "base_model_name_or_path": "Qwen/Qwen3-30B-A3B"})";
  loom::checkpoint::save_safetensors(adapter / "adapter_model.safetensors",
                                     {{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch::zeros({4, 32})}});
  const RunResult r = run(loom_bin() + " score --checkpoint " + base.string() + " --tokens 1,2,3 --adapter " +
                              adapter.string(), 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("does not fit this llama3 base: its target_modules name 'gate'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("it was made for another model (Qwen/Qwen3-30B-A3B)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("lora.target_modules"), std::string::npos) << r.output;
}

// Issue 46 (11): `loom score` of more tokens than the model's max_seq_len is one line, exit 2,
// before loading (RoPE past the trained positions makes the scores meaningless); it was accepted.
TEST(Faults, ScoreBeyondMaxSeqLenIsRefused) {
  TempDir dir("score-long");
  test_faults::tiny_checkpoint(dir.path() / "model", 1);  // max_seq_len 32
  std::string tokens = "1";
  for (int i = 0; i < 32; ++i) tokens += ",2";
  const RunResult r = run(loom_bin() + " score --checkpoint " + (dir.path() / "model").string() + " --tokens " + tokens, 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output.rfind("error: the 33 tokens to score are more than the model's max_seq_len of 32", 0), 0u)
      << r.output;
  const RunResult fits =
      run(loom_bin() + " score --checkpoint " + (dir.path() / "model").string() + " --tokens " + tokens.substr(2), 60);
  EXPECT_EQ(fits.exit_code, 0) << fits.output;
}

// Item 11: a tokenizer smaller than the model's vocabulary (a padded embedding table) is accepted
// as Hugging Face does: sampled ids without a token are left out of the text, with one warning,
// instead of failing mid-output. The head is rigged so that greedy decoding always picks a padded id.
TEST(Faults, GenerateWithATokenizerSmallerThanTheVocabularyLeavesUnknownIdsOut) {
  TempDir dir("gen-tokenizer");
  const std::string tokenizer = src("data/default/tokenizer.json");
  const int64_t known = loom::data::Tokenizer::from_file(tokenizer).vocab_size();
  auto model = test_faults::tiny_llama(3, known + 8);
  {
    torch::NoGradGuard no_grad;
    torch::Tensor head = model->output().weight();
    const torch::Tensor row = torch::randn({head.size(1)});
    head.zero_();
    head[known].copy_(row * 10);      // one of these two padded ids has the largest logit
    head[known + 1].copy_(row * -10);
  }
  loom::models::save_loom_checkpoint(loom::models::get_spec("llama3"), *model, dir.path() / "model");
  const RunResult r = run(loom_bin() + " generate --checkpoint " + (dir.path() / "model").string() +
                          " --tokenizer " + tokenizer + " --prompt hi --max-new-tokens 3 --temperature 0", 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the tokenizer has " + std::to_string(known) + " ids but the model " +
                          std::to_string(known + 8)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("3 new tokens"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("cannot decode"), std::string::npos) << r.output;
}

// Item 11: a model whose config cannot fit in memory fails with what was being allocated, its size
// and what to change, not the allocator's bare "can't allocate memory". The config (Hugging Face
// format, as downloaded) claims 2^50 positions: its RoPE table alone is petabytes.
TEST(Faults, OutOfMemoryAtModelBuildSaysWhatAndHowMuch) {
  TempDir dir("oom");
  auto model = test_faults::tiny_llama(4);
  loom::models::export_hf_model_dir(loom::models::get_spec("llama3"), *model, dir.path() / "hf");
  std::ifstream in(dir.path() / "hf" / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["max_position_embeddings"] = int64_t{1} << 50;
  std::ofstream(dir.path() / "hf" / "config.json") << config.dump(2);
  const RunResult r = run(loom_bin() + " convert --to loom --input " + (dir.path() / "hf").string() +
                          " --output " + (dir.path() / "out").string(), 60);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "error: "), 1) << r.output;
  EXPECT_NE(r.output.find("error: out of memory allocating the model ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("max_seq_len 1125899906842624"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" GiB on cpu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("; use a machine with more memory or a smaller model"), std::string::npos) << r.output;
}

// Issue 22, item 4: a dataset path that blocks on open (a FIFO with no writer) hung every rank for
// good. Now the paths are resolved before rendezvous (stat, never open) and every reader opens
// without blocking: one line per rank, exit 2, in seconds, under the launcher.
TEST(Faults, FifoDatasetFailsAtStartInsteadOfHanging) {
  TempDir dir("fifo");
  const fs::path fifo = dir.path() / "corpus.jsonl";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  RunResult r = run(launch(2) + train_args(dir, 2, " --training.dataset_path=" + fifo.string()), 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("training.dataset_path = \"" + fifo.string() + "\" is a FIFO (named pipe), not a regular file"),
            std::string::npos) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << r.output;
}

// Issue 22, item 10: a JSONL parse error quotes the start of a 2 MB record and its size, so each
// rank's error line, and the launcher's, stay short.
TEST(Faults, HugeBadJsonlRecordIsQuotedAsAnExcerpt) {
  TempDir dir("hugejsonl");
  const fs::path data = dir.path() / "corpus.jsonl";
  std::ofstream(data) << "{\"text\": \"fine\"}\n{\"text\": \"" << std::string(2'000'000, 'x') << "\n";
  RunResult r = run(launch(2) + train_args(dir, 2, " --training.dataset_path=" + data.string()), 60);
  EXPECT_NE(r.exit_code, 0) << r.output.substr(0, 4000);
  EXPECT_NE(r.output.find(data.string() + ":2: not valid JSON"), std::string::npos) << r.output.substr(0, 4000);
  EXPECT_NE(r.output.find("bytes)"), std::string::npos) << r.output.substr(0, 4000);
  EXPECT_LT(r.output.size(), 20'000u) << r.output.substr(0, 4000);
}

// Issue 22, item 11: a full disk under job.dump_folder at start. config.toml was written through an
// unchecked stream (0 bytes) and the run failed after step 1. The file is now written to
// config.toml.tmp and checked; that path made a link to /dev/full (every write: ENOSPC) is a full
// disk for it, deterministically.
TEST(Faults, FullDiskForConfigTomlFailsAtStart) {
  TempDir dir("fulldisk");
  fs::create_symlink("/dev/full", dir.path() / "config.toml.tmp");
  RunResult r = run(loom_bin() + train_args(dir, 2, " --parallelism.data_parallel_shard_degree=1"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: cannot write '" + (dir.path() / "config.toml").string() +
                          "': No space left on device"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[step "), std::string::npos) << "trained before failing:\n" << r.output;
  EXPECT_EQ(count_occurrences(r.output, "error:"), 1) << r.output;
}

namespace test_faults {
// How many lines of `text` contain `part` (a launcher line quoting ranks' lines counts once).
int lines_containing(const std::string& text, const std::string& part) {
  std::istringstream in(text);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(part) != std::string::npos ? 1 : 0;
  return n;
}
}  // namespace test_faults

// Issue 22, item 3: a checkpoint saved by another model shape, vocabulary, optimizer, sequence
// length or corpus cannot load under this configuration however often it is retried. Before: each
// message was clear but the exit code was 1 and `loom launch --max-restarts 2` tried three times.
// Now exit 2 (IncompatibleCheckpointError) after one attempt, and one line from the launcher.
TEST(Faults, IncompatibleCheckpointExits2WithoutRestarts) {
  TempDir dir("incompatible");
  const std::string ckpt = " --checkpoint.enable=true --checkpoint.interval=2";
  const RunResult saved = run(launch(2) + train_args(dir, 2, ckpt));
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  // The acceptance case: another vocabulary under `loom launch --max-restarts 2`.
  const RunResult r = run(launch(2, " --max-restarts 2") + train_args(dir, 4, ckpt + " --model.vocab_size=4096"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output.find("loom launch: restart"), std::string::npos) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("\nerror: rank [01] \\(local rank [01], pid [0-9]+\\) exited "
                                                     "with code 2 \\(configuration or usage error\\)")))
      << r.output;
  // The recorded model is compared before any tensor is read (issue 47): the field that differs.
  EXPECT_NE(r.output.find("checkpoint " + dir.str() + "/checkpoint/step-2 holds a model of another shape than this "
                          "run's (model_args.vocab_size 2048 in the checkpoint, 4096 in this run)"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not restarted: a configuration or usage error (or a checkpoint this "
                          "configuration cannot load) does not go away with a restart"),
            std::string::npos) << r.output;
  // The other mismatches, one process each (it reshards the 2-rank checkpoint).
  struct Case {
    std::string flags, message;
  };
  const Case cases[] = {
      {" --model.n_layers=7", "(model_args.n_layers 6 in the checkpoint, 7 in this run)"},
      {" --optimizer.name=Muon", "is not in checkpoint '"},
      {" --training.seq_len=32", "data loader state was saved with seq_len 64 but this run uses 32"},
      {" --training.dataset_path=" + src("data/default/validation.jsonl"),
       "data loader state was saved for a corpus of "},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    const RunResult one = run(loom_bin() + train_args(dir, 4, ckpt + c.flags +
                                                          " --parallelism.data_parallel_shard_degree=1"));
    EXPECT_EQ(one.exit_code, 2) << one.output;
    EXPECT_NE(one.output.find(c.message), std::string::npos) << one.output;
  }
}

// Issue 22, item 11: a configuration error under `loom launch` is one line in all (before: one per
// rank plus the launcher's repeating each rank's copy, 5 lines on 4 ranks).
TEST(Faults, ConfigErrorUnderLaunchIsOneLine) {
  TempDir dir("oneline");
  const RunResult r = run(launch(4) + train_args(dir, 4, " --optimizer.lr=-1"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "'optimizer.lr' must be >= 0"), 1) << r.output;
  EXPECT_EQ(test_faults::lines_containing(r.output, "error: "), 1) << r.output;
  // The launcher's line, quoting whichever rank reported first.
  EXPECT_TRUE(std::regex_search(r.output, std::regex("(^|\n)error: rank [0-3] \\(local rank [0-3], pid [0-9]+\\) "
                                                     "exited with code 2 \\(configuration or usage error\\): "
                                                     "\\[rank[0-3]\\] error: config key 'optimizer.lr'")))
      << r.output;
}

// Issue 22, item 11: `--checkpoint-folder` naming another folder than the ranks' made the restart
// line say "ranks start from scratch" while they resumed from step 4. The launcher now checks it
// against the ranks' own configuration before starting them.
TEST(Faults, LaunchCheckpointFolderMustBeTheRanksOwn) {
  TempDir dir("ckptfolder"), other("elsewhere");
  const std::string ckpt = " --checkpoint.enable=true --checkpoint.interval=2";
  const RunResult wrong = run(launch(2, " --max-restarts 1 --checkpoint-folder " + other.str()) +
                              train_args(dir, 4, ckpt));
  EXPECT_EQ(wrong.exit_code, 2) << wrong.output;
  EXPECT_NE(wrong.output.find("error: --checkpoint-folder '" + other.str() + "' is not where the ranks "
                              "checkpoint ('" + dir.str() + "/checkpoint', job.dump_folder/checkpoint.folder"),
            std::string::npos) << wrong.output;
  EXPECT_EQ(wrong.output.find("[step "), std::string::npos) << wrong.output;
  // The right folder: the restart line names the checkpoint the ranks resume from.
  const RunResult right = run("env LOOM_FAULT_THROW=1:3 " +
                              launch(2, " --max-restarts 1 --checkpoint-folder " + dir.str() + "/checkpoint") +
                              train_args(dir, 4, ckpt));
  EXPECT_EQ(right.exit_code, 0) << right.output;
  EXPECT_NE(right.output.find("; ranks resume from checkpoint '" + dir.str() + "/checkpoint/step-2' (step 2)"),
            std::string::npos) << right.output;
  EXPECT_NE(right.output.find("resumed from " + dir.str() + "/checkpoint/step-2 at step 2"), std::string::npos)
      << right.output;
}

// Issue 22, item 1: two runs with different job.dump_folder but one checkpoint.folder (absolute).
// Before: the second resumed from the first's newest checkpoint and both wrote and pruned the same
// folder. Now: the second is refused (exit 2) naming the folder and the first run's pid, before
// it reads or writes anything there.
TEST(FaultsShared, SecondRunOnTheSameCheckpointFolderIsRefused) {
  TempDir dir("shared_ckpt");
  const fs::path ckpt = dir.path() / "shared";
  const std::string flags = " --checkpoint.enable=true --checkpoint.interval=1 --checkpoint.keep_latest_k=2"
                            " --checkpoint.folder=" + ckpt.string() +
                            " --parallelism.data_parallel_shard_degree=1";
  const fs::path log = dir.path() / "first.log";
  const std::string first = loom_bin() + train_args(dir.path() / "a", 100000, flags) + " > " +
                            log.string() + " 2>&1 & echo $!";
  RunResult started = run("bash -c '" + first + "'", 30);
  const pid_t pid = static_cast<pid_t>(std::stol(started.output));
  bool saved = false;
  for (int i = 0; i < 600 && !saved; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    saved = fs::exists(ckpt / "step-1" / "COMPLETE");
  }
  ASSERT_TRUE(saved) << file_bytes(log);
  RunResult second = run(loom_bin() + train_args(dir.path() / "b", 3, flags));
  kill(pid, SIGKILL);
  EXPECT_EQ(second.exit_code, 2) << second.output;
  EXPECT_NE(second.output.find("checkpoint.folder (with job.dump_folder) '" + ckpt.string() +
                               "' is in use by another Loom run (pid " + std::to_string(pid)),
            std::string::npos)
      << second.output;
  EXPECT_EQ(second.output.find("resum"), std::string::npos) << second.output;
  // The second run trained nothing: no metrics of its own.
  EXPECT_FALSE(fs::exists(dir.path() / "b" / "metrics.jsonl") &&
               fs::file_size(dir.path() / "b" / "metrics.jsonl") > 0);
  // checkpoint.folder = "." (the dump folder itself) is one folder and one lock: not a self-conflict.
  for (int i = 0; i < 100 && kill(pid, 0) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  RunResult dot = run(loom_bin() + train_args(dir.path() / "c", 2,
                                               " --checkpoint.enable=true --checkpoint.folder=."
                                               " --parallelism.data_parallel_shard_degree=1"));
  EXPECT_EQ(dot.exit_code, 0) << dot.output;
  EXPECT_TRUE(fs::exists(dir.path() / "c" / "step-2" / "COMPLETE")) << dot.output;
}

// Issue 22, item 2: LOOM_FAULT_NAN under pipeline parallelism. Before: it did nothing (the pipeline
// path ignored the hook) and the run exited 0. Now: a NaN injected on either pipeline rank (the
// first stage's activations, or the last stage's loss) stops both ranks with exit 3, not restarted.
TEST(FaultsShared, DivergenceDrillStopsAPipelineFromEitherStage) {
  for (int rank : {0, 1}) {
    TempDir dir("pp_nan");
    RunResult r = run("env LOOM_FAULT_NAN=" + std::to_string(rank) + ":3 " + launch(2, " --max-restarts 1") +
                      train_args(dir.path(), 6, " --parallelism.pipeline_parallel_degree=2"));
    EXPECT_EQ(r.exit_code, 3) << "NaN on rank " << rank << "\n" << r.output;
    EXPECT_NE(r.output.find("training diverged: non-finite loss nan"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("at step 3"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("loom launch: restart"), std::string::npos) << r.output;
  }
}

// Issue 22, item 2: a real non-finite loss under pipeline parallelism (lr 1e3, as the single-rank
// divergence test) is caught by the same guard: exit 3 naming the step.
TEST(FaultsShared, RealDivergenceUnderPipelineParallelismStopsTheRun) {
  TempDir dir("pp_diverge");
  RunResult r = run(launch(2) + train_args(dir.path(), 30, " --optimizer.lr=1e3"
                                                           " --parallelism.pipeline_parallel_degree=2"));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("error: training diverged: non-finite"), std::string::npos) << r.output;
}

// Issue 22, item 4: every open of a user-given path is non-blocking. `loom score --text-file` on a
// FIFO with no writer blocked for good; it is refused at once (exit 2), naming the option.
TEST(FaultsShared, ScoreTextFileFifoIsRefusedWithoutBlocking) {
  TempDir dir("score_fifo");
  const fs::path fifo = dir.path() / "text.txt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  fs::create_directories(dir.path() / "ckpt");
  const auto start = std::chrono::steady_clock::now();
  RunResult r = run(loom_bin() + " score --checkpoint " + (dir.path() / "ckpt").string() +
                        " --tokenizer " + src("data/default/tokenizer.json") +
                        " --text-file " + fifo.string(),
                    30);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--text-file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("FIFO"), std::string::npos) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}
