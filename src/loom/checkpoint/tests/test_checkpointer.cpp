// Async saving (staging isolation, bounded staging, error reporting) and the Checkpointer policy.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "loom/core/dtype.h"
#include "loom/checkpoint/checkpointer.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/tests/layouts.h"
#include "loom/core/timer.h"
#include "loom/testing/run.h"

namespace {
namespace fs = std::filesystem;
using namespace loom::checkpoint;
using namespace loom::checkpoint::testing;
using loom::testing::TempDir;

void fill_chunks(const ShardedStateDict& state, double value) {
  for (const auto& [name, t] : state.tensors()) {
    for (const LocalChunk& c : t.chunks) c.data.fill_(value);
  }
}

// An async save returns after planning and copies the state out while training goes on; once
// wait_staged() returns the optimizer may step, and the checkpoint still holds the state of the
// step it was started at: byte for byte what a synchronous save of that state writes. Staging
// budgets: 4 KiB (1 KiB slots, buffered writes), 64 KiB (16 KiB slots reused many times, O_DIRECT)
// and the default (one slot, O_DIRECT with a padded last block).
TEST(AsyncSave, WritesTheSameBytesAsSyncAndIgnoresLaterTrainingUpdates) {
  auto specs = training_specs();
  for (const Spec& s : bulk_specs(1)) specs.push_back(s);  // 1 MiB more: many slots
  for (const int64_t staging_bytes : {int64_t{4096}, int64_t{64} << 10, SaverOptions{}.staging_max_bytes}) {
    SCOPED_TRACE(staging_bytes);
    TempDir sync_dir("ckpt"), async_dir("ckpt");
    SaverOptions options;
    options.staging_max_bytes = staging_bytes;
    const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<CheckpointGroup> group) {
      ShardedStateDict state = make_state(specs, fsdp_layout(specs, 2, rank), 1);
      ShardedSaver saver(group, options);
      saver.save(state, sync_dir.path(), 1);
      saver.begin_async_save(state, async_dir.path(), 1);
      saver.wait_staged();
      EXPECT_FALSE(saver.staging());
      fill_chunks(state, 0);  // the optimizer steps on while the save is written
      saver.wait();
      EXPECT_FALSE(saver.in_flight());
      EXPECT_GT(saver.last_stats().bytes, 0);
    });
    for (const auto& e : errors) ASSERT_EQ(e, "");
    for (const char* file : {"rank-0.safetensors", "rank-1.safetensors", "metadata.json",
                             "COMPLETE"}) {
      EXPECT_EQ(loom::testing::file_bytes(sync_dir.path() / "step-1" / file),
                loom::testing::file_bytes(async_dir.path() / "step-1" / file))
          << file;
    }
    verify_checkpoint(async_dir.path() / "step-1", Verification::kChecksums);
    ShardedStateDict dest = make_state(specs, full_layout(), -1);
    load_checkpoint(async_dir.path() / "step-1", dest);
    EXPECT_EQ(check_state(specs, dest, 1), "");
  }
}

// A model-only export in another dtype is converted while staging (not the raw-copy path).
TEST(AsyncSave, ExportDtypeMatchesTheSynchronousSave) {
  TempDir sync_dir("ckpt"), async_dir("ckpt");
  const auto specs = training_specs();
  ShardedStateDict state = make_state(specs, full_layout(), 3);
  SaveOptions export_bf16;
  export_bf16.model_only = true;
  export_bf16.export_dtype = c10::kBFloat16;
  ShardedSaver saver(single_process_group());
  saver.save(state, sync_dir.path(), 3, export_bf16);
  saver.save_async(state, async_dir.path(), 3, export_bf16);
  saver.wait();
  for (const char* file : {"rank-0.safetensors", "metadata.json", "COMPLETE"}) {
    EXPECT_EQ(loom::testing::file_bytes(sync_dir.path() / "step-3" / file),
              loom::testing::file_bytes(async_dir.path() / "step-3" / file))
        << file;
  }
  verify_checkpoint(async_dir.path() / "step-3", Verification::kChecksums);
}

TEST(AsyncSave, ConsecutiveSavesWaitForThePreviousOne) {
  TempDir dir("ckpt");
  const auto specs = training_specs();
  ShardedSaver saver(single_process_group());
  for (int step = 1; step <= 3; ++step) {
    ShardedStateDict state = make_state(specs, full_layout(), step);
    saver.save_async(state, dir.path(), step);
  }
  saver.wait();
  const auto complete = list_complete_checkpoints(dir.path());
  ASSERT_EQ(complete.size(), 3u);
  for (const auto& info : complete) {
    verify_checkpoint(info.path, Verification::kChecksums);
    ShardedStateDict dest = make_state(specs, full_layout(), -1);
    load_checkpoint(info.path, dest);
    EXPECT_EQ(check_state(specs, dest, static_cast<int>(info.step)), "");
  }
}

TEST(AsyncSave, BackgroundFailuresSurfaceOnTheNextCall) {
  // Rank 1 writes into a folder where its data file is blocked by a directory, so its background
  // writer fails; rank 0 then waits in vain for rank 1's report.
  TempDir good("ckpt"), blocked("ckpt");
  fs::create_directories(blocked.path() / "step-1.tmp" / "rank-1.safetensors");
  SaverOptions impatient;
  impatient.finalize_timeout = std::chrono::milliseconds(300);
  const auto specs = training_specs();
  const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<CheckpointGroup> group) {
    ShardedStateDict state = make_state(specs, fsdp_layout(specs, 2, rank), 1);
    ShardedSaver saver(group, impatient);
    if (rank == 0) {
      saver.save_async(state, good.path(), 1);
      saver.save_async(state, good.path(), 2);  // first reports step 1's failure
    } else {
      saver.save_async(state, blocked.path(), 1);
      saver.wait();
    }
  });
  EXPECT_NE(errors[0].find("rank(s) 1 did not finish writing"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank-1.safetensors"), std::string::npos) << errors[1];
  EXPECT_TRUE(fs::exists(blocked.path() / "step-1.tmp" / "rank-1.failed"));
  EXPECT_TRUE(list_complete_checkpoints(good.path()).empty());
}

TEST(Checkpointer, SavesOnIntervalAndLastStepAndResumes) {
  TempDir dir("ckpt");
  const auto specs = training_specs();
  CheckpointOptions options;
  options.folder = dir.path();
  options.interval = 2;
  options.async = true;
  options.last_save_model_only = true;
  options.export_dtype = loom::parse_dtype("bf16", "checkpoint.export_dtype");
  int provided = 0;
  {
    Checkpointer ckpt(options, single_process_group());
    for (int step = 1; step <= 5; ++step) {
      EXPECT_EQ(ckpt.due(step, step == 5), step % 2 == 0 || step == 5);
      ckpt.maybe_save(
          step,
          [&] {
            ++provided;
            return make_state(specs, full_layout(), step);
          },
          step == 5);
    }
    EXPECT_FALSE(fs::exists(dir.path() / "step-5.tmp"));  // the last save was waited for
  }
  EXPECT_EQ(provided, 3);
  const auto complete = list_complete_checkpoints(dir.path());
  ASSERT_EQ(complete.size(), 3u);
  const CheckpointMetadata last = CheckpointMetadata::read(dir.path() / "step-5");
  EXPECT_TRUE(last.model_only);
  EXPECT_EQ(last.tensors.at("model.tok_embeddings.weight").dtype, c10::kBFloat16);

  // Resuming the full state from a chosen step.
  options.load_step = 4;
  Checkpointer resume(options, single_process_group());
  ShardedStateDict dest = make_state(specs, fsdp_layout(specs, 1, 0), -1);
  const auto loaded = resume.load(dest);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 4);
  EXPECT_EQ(loaded->json.at("loader").at("offset"), 1004);
  EXPECT_EQ(check_state(specs, dest, 4), "");
  // The newest checkpoint is the model-only export, which cannot resume training.
  options.load_step.reset();
  Checkpointer latest(options, single_process_group());
  EXPECT_THROW(latest.load(dest), loom::Error);
  // A missing step is a usage error.
  options.load_step = 3;
  Checkpointer missing(options, single_process_group());
  EXPECT_THROW(missing.load(dest), loom::UsageError);
}

TEST(Checkpointer, RejectsBadOptions) {
  CheckpointOptions o;
  EXPECT_THROW(o.validate(), loom::UsageError);  // no folder
  o.folder = "/tmp/x";
  o.validate();
  o.interval = -1;
  EXPECT_THROW(o.validate(), loom::UsageError);
  o.interval = 10;
  o.export_dtype = c10::kBFloat16;
  EXPECT_THROW(o.validate(), loom::UsageError);  // export without model-only
  o.last_save_model_only = true;
  o.validate();
  o.staging_max_bytes = 10;
  EXPECT_THROW(Checkpointer(o, single_process_group()), loom::UsageError);
  EXPECT_THROW(loom::parse_dtype("int8", "checkpoint.export_dtype"), loom::UsageError);
  EXPECT_EQ(loom::parse_dtype("float16", "checkpoint.export_dtype"), c10::kHalf);
}

// About 96 MiB of float32 state: sync save, async save (training-thread time and total), load and
// resharded load. Prints MB/s; values are checked bitwise.
TEST(Throughput, SavesAndLoads96MiB) {
  TempDir dir("ckpt");
  const auto specs = bulk_specs(96);
  ShardedStateDict state = make_state(specs, full_layout(), 1);
  const double mb = static_cast<double>(state.local_bytes()) / 1e6;
  ShardedSaver saver(single_process_group());

  loom::Timer t;
  saver.save(state, dir.path(), 1);
  const double sync_s = t.seconds();
  // The first async save allocates (and faults in) the staging slots; later ones reuse them.
  saver.save_async(state, dir.path(), 2);
  saver.wait();
  t.reset();
  saver.save_async(state, dir.path(), 3);
  const double staged_s = t.seconds();
  saver.wait();
  const double async_s = t.seconds();

  ShardedStateDict dest = make_state(specs, full_layout(), -1);
  t.reset();
  load_checkpoint(dir.path() / "step-3", dest);
  const double load_s = t.seconds();
  EXPECT_EQ(check_state(specs, dest, 1), "");

  double reshard_s = 0;
  const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<CheckpointGroup> group) {
    ShardedStateDict part = make_state(specs, fsdp_layout(specs, 2, rank), -1);
    loom::Timer rt;
    load_latest(dir.path(), part, *group);
    if (rank == 0) reshard_s = rt.seconds();
    const std::string mismatch = check_state(specs, part, 1);
    if (!mismatch.empty()) throw std::runtime_error(mismatch);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  std::printf(
      "checkpoint throughput, %.1f MB: sync save %.0f MB/s (%.3f s); async save blocks training "
      "%.3f s, done after %.3f s (%.0f MB/s); load %.0f MB/s (%.3f s); load at 2 ranks %.3f s\n",
      mb, mb / sync_s, sync_s, staged_s, async_s, mb / async_s, mb / load_s, load_s, reshard_s);
  RecordProperty("sync_save_MBps", static_cast<int>(mb / sync_s));
  RecordProperty("load_MBps", static_cast<int>(mb / load_s));
}

}  // namespace
