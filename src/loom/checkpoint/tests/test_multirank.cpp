// Checkpoints across real processes: ranks started by `loom launch` save with one world size and
// layout and load with another (loom_checkpoint_worker checks the values on every rank).
#include <gtest/gtest.h>

#include <fstream>

#include "loom/checkpoint/metadata.h"
#include "loom/testing/run.h"

namespace {
namespace fs = std::filesystem;
using loom::testing::bin_dir;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

RunResult launch(int nproc, const std::string& args) {
  return run(bin_dir() + "/loom launch --nproc " + std::to_string(nproc) + " --exec -- " +
             bin_dir() + "/loom_checkpoint_worker " + args);
}

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(MultiRankCheckpoint, FourRanksSaveTwoLoadAndTwoReplicasSaveFourLoad) {
  TempDir dir("ckpt");
  const std::string folder = dir.str() + "/ckpt";
  RunResult r = launch(4, "save " + folder + " fsdp 10 1 async");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "saved step 10"), 4) << r.output;
  EXPECT_TRUE(fs::exists(folder + "/step-10/COMPLETE"));

  r = launch(2, "load " + folder + " fsdp 10 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "loaded step 10 saved by 4 ranks"), 2) << r.output;

  // Two processes holding the whole state (2 replicas of one shard) write it once between them.
  r = launch(2, "save " + folder + " hsdp 20 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto m = loom::checkpoint::CheckpointMetadata::read(folder + "/step-20");
  EXPECT_EQ(m.file_bytes.size(), 2u);
  r = launch(4, "load " + folder + " fsdp 20 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "loaded step 20 saved by 2 ranks"), 4) << r.output;
}

TEST(MultiRankCheckpoint, CorruptNewestCheckpointFallsBackOnEveryRank) {
  TempDir dir("ckpt");
  const std::string folder = dir.str() + "/ckpt";
  ASSERT_EQ(launch(2, "save " + folder + " fsdp 1 1").exit_code, 0);
  ASSERT_EQ(launch(2, "save " + folder + " fsdp 2 2").exit_code, 0);
  // Damage one byte that only rank 1 reads when loading at the same layout.
  const fs::path victim = folder + "/step-2/rank-1.safetensors";
  const auto m = loom::checkpoint::CheckpointMetadata::read(folder + "/step-2");
  int64_t offset = -1;
  for (const auto& [name, t] : m.tensors) {
    for (const auto& c : t.chunks) {
      if (c.file == "rank-1.safetensors") offset = c.byte_begin;
    }
  }
  ASSERT_GE(offset, 0);
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(offset);
    f.put('\x7f');
    f.put('\x01');
  }
  const RunResult r = launch(2, "load " + folder + " fsdp 1 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "loaded step 1 saved by 2 ranks"), 2) << r.output;
  EXPECT_NE(r.output.find(victim.string()), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("falling back"), std::string::npos) << r.output;
}

}  // namespace
