// Faults round 3 (issue 22): a checkpoint folder shared by two runs, and the divergence drill and a
// real divergence under pipeline parallelism. Same conventions as test_faults.cpp: the `loom`
// binary driven as a user would, a debug model at seq 64, asserted on exit codes, the one-line
// messages and what is on disk.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "loom/core/build_paths.h"
#include "loom/testing/run.h"

namespace faults_shared_test {
namespace fs = std::filesystem;
using loom::testing::file_bytes;
using loom::testing::loom_bin;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

std::string source(const std::string& rel) { return std::string(loom::kSourceDir) + "/" + rel; }

std::string debug_train(const fs::path& dump, int steps, const std::string& extra = "") {
  return " train --config " + source("configs/llama3_debug.toml") + " --validation.enable=false" +
         " --model.tokenizer_path=" + source("data/default/tokenizer.json") +
         " --training.dataset_path=" + source("data/default/corpus.jsonl") +
         " --job.dump_folder=" + dump.string() + " --training.seq_len=64 --training.local_batch_size=2" +
         " --training.steps=" + std::to_string(steps) +
         " --lr_scheduler.warmup_steps=2 --metrics.log_freq=1 --metrics.peak_flops=1e11"
         " --comm.timeout_seconds=120" + extra;
}

std::string launch2(const std::string& flags = "") {
  return loom_bin() + " launch --nproc 2" + flags + " --";
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
  const std::string first = loom_bin() + debug_train(dir.path() / "a", 100000, flags) + " > " +
                            log.string() + " 2>&1 & echo $!";
  RunResult started = run("bash -c '" + first + "'", 30);
  const pid_t pid = static_cast<pid_t>(std::stol(started.output));
  bool saved = false;
  for (int i = 0; i < 600 && !saved; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    saved = fs::exists(ckpt / "step-1" / "COMPLETE");
  }
  ASSERT_TRUE(saved) << file_bytes(log);
  RunResult second = run(loom_bin() + debug_train(dir.path() / "b", 3, flags));
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
  RunResult dot = run(loom_bin() + debug_train(dir.path() / "c", 2,
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
    RunResult r = run("env LOOM_FAULT_NAN=" + std::to_string(rank) + ":3 " + launch2(" --max-restarts 1") +
                      debug_train(dir.path(), 6, " --parallelism.pipeline_parallel_degree=2"));
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
  RunResult r = run(launch2() + debug_train(dir.path(), 30, " --optimizer.lr=1e3"
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
                        " --tokenizer " + source("data/default/tokenizer.json") +
                        " --text-file " + fifo.string(),
                    30);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--text-file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("FIFO"), std::string::npos) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

}  // namespace faults_shared_test
