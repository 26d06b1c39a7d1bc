// Sharded save: every rank writes only the chunks it owns, rank 0 publishes the checkpoint once all
// ranks are done.
//
// Protocol for step N into <folder> (see metadata.h for the files):
//   1. (training thread, collective) every rank sends its chunk list; all ranks compute the same
//      global plan: identical ranges held by several ranks (replicas) get one writer, chosen to
//      balance bytes; partial overlaps, gaps and shape/dtype disagreements are errors on every
//      rank. Rank 0 first removes a stale step-N.tmp left by a crashed run.
//   2. each rank writes step-N.tmp/rank-R.safetensors (fsync), then rank-R.meta.json with a CRC-32C
//      per chunk (fsync file and directory). A rank that fails writes rank-R.failed instead.
//   3. rank 0 waits for every rank's meta file, writes metadata.json, renames step-N.tmp to step-N,
//      writes step-N/COMPLETE (each step fsynced), then prunes to keep_latest_k.
// Async saves run steps 2-3 on background threads that never communicate, so they cannot
// interleave with the training thread's collectives:
//   - a staging thread copies this rank's chunks into host memory, computing the CRC-32C in the
//     same pass. Staging memory is bounded (staging_max_bytes, in page-aligned slots of at most
//     64 MiB that the writer drains while later ones are filled; kept from save to save). Chunks
//     on a CUDA device are first copied into pinned host buffers at planning time (non-blocking,
//     on the training thread's stream, overlapping the next step's kernels; the buffers are kept
//     from save to save); the staging thread waits for those copies once, then reads them;
//   - a writer thread writes the slots (O_DIRECT where the filesystem allows it, so no page-cache
//     copy and no writeback work competes with training), then reports and publishes.
// Both run at the lowest CPU priority. begin_async_save returns right after planning, so the
// staging copy overlaps the training that follows; the caller must not modify the saved tensors
// until wait_staged() returns — a trainer calls it just before the optimizer step, the first
// thing that changes parameters or optimizer state. JSON state is copied at planning time.
// save_async is begin_async_save + wait_staged.
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>

#include "loom/checkpoint/group.h"
#include "loom/checkpoint/state_dict.h"

namespace loom::checkpoint {

struct SaveOptions {
  bool model_only = false;                      // only component "model"
  std::optional<c10::ScalarType> export_dtype;  // floating-point tensors are stored in this dtype
};

struct SaverOptions {
  int keep_latest_k = 0;  // rank 0 keeps the newest k complete checkpoints; 0 keeps all
  int64_t staging_max_bytes = int64_t{1} << 30;  // async staging memory per rank
  std::chrono::milliseconds finalize_timeout = std::chrono::minutes(30);  // rank 0 waits this long
};

struct SaveStats {
  int64_t step = -1;
  int64_t bytes = 0;            // written by this rank
  double blocked_seconds = 0;   // training thread: planning + waiting for staging (async), or the
                                // whole save
  double write_seconds = 0;     // writing (background thread for async), incl. rank 0's finalize
};

class ShardedSaver {
 public:
  explicit ShardedSaver(std::shared_ptr<CheckpointGroup> group, SaverOptions options = {});
  ~ShardedSaver();  // waits for a pending save; logs its error (a destructor cannot throw)
  ShardedSaver(const ShardedSaver&) = delete;
  ShardedSaver& operator=(const ShardedSaver&) = delete;

  // Synchronous: returns <folder>/step-<step> once it is complete for every rank.
  std::filesystem::path save(const ShardedStateDict& state, const std::filesystem::path& folder,
                             int64_t step, const SaveOptions& options = {});
  // Waits for the previous save, plans (collective) and returns; staging and writing continue in
  // the background. The tensors in `state` must stay unmodified until wait_staged() returns.
  void begin_async_save(const ShardedStateDict& state, const std::filesystem::path& folder,
                        int64_t step, const SaveOptions& options = {});
  // Blocks until the pending async save has copied every chunk out of the live tensors (no-op when
  // none is pending); rethrows a failure of the save that is already known.
  void wait_staged();
  // begin_async_save + wait_staged: the live tensors may be modified as soon as it returns.
  void save_async(const ShardedStateDict& state, const std::filesystem::path& folder, int64_t step,
                  const SaveOptions& options = {});
  // Blocks until the pending async save is written (on rank 0: published); rethrows its error.
  void wait();
  bool in_flight() const { return writer_.joinable(); }
  bool staging() const { return stager_.joinable(); }

  const SaveStats& last_stats() const { return stats_; }
  const SaverOptions& options() const { return options_; }

  struct Job;    // one save in progress (saver.cpp)
  class Staging;  // bounded host-memory slots between the training and writer threads

 private:
  std::shared_ptr<Job> plan(const ShardedStateDict& state, const std::filesystem::path& folder,
                            int64_t step, const SaveOptions& options);

  std::shared_ptr<CheckpointGroup> group_;
  SaverOptions options_;
  std::unique_ptr<Staging> staging_;
  // Pinned host copies of the CUDA chunks of async saves, in entry order, reused by the next save.
  std::vector<torch::Tensor> pinned_;
  std::shared_ptr<Job> job_;
  std::thread stager_;
  std::thread writer_;
  SaveStats stats_;
};

}  // namespace loom::checkpoint
