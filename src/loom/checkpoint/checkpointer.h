// The trainer's checkpointing policy around ShardedSaver and the loader: when to save (every
// `interval` steps and at the last step), sync or async, how many to keep, what the final save
// holds (model only, export dtype), and what to resume from.
//
// Typical use in a training loop:
//   Checkpointer ckpt(options, checkpoint::comm_group(world));
//   ShardedStateDict live = build_state();            // views into model/optimizer/... tensors
//   if (auto loaded = ckpt.load(live)) { restore JSON state from loaded->json; start = loaded->step; }
//   for (step = start + 1; step <= steps; ++step) {
//     forward_backward();
//     ckpt.wait_staged();  // an async save of the previous step may still be copying the state
//     optimizer_step();
//     ckpt.maybe_save(step, build_state, step == steps);  // build_state only runs when due
//   }
//   ckpt.wait();
#pragma once
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "loom/checkpoint/group.h"
#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/saver.h"
#include "loom/checkpoint/state_dict.h"

namespace loom::checkpoint {

struct CheckpointOptions {
  std::filesystem::path folder;
  int64_t interval = 500;  // save every `interval` steps; 0 = only the last step
  int keep_latest_k = 0;   // 0 keeps every checkpoint
  bool async = false;      // stage into host memory and write in the background
  int64_t staging_max_bytes = int64_t{1} << 30;
  // The save at the last step holds only the model (TorchTitan's model_weights_only), stored in
  // `export_dtype` when set (floating-point tensors only).
  bool last_save_model_only = false;
  std::optional<c10::ScalarType> export_dtype;
  std::optional<int64_t> load_step;  // resume from this step instead of the newest usable one
  std::chrono::milliseconds finalize_timeout = std::chrono::minutes(30);

  // One-line loom::UsageError naming the bad field and the fix.
  void validate() const;
};


class Checkpointer {
 public:
  using StateProvider = std::function<ShardedStateDict()>;

  Checkpointer(CheckpointOptions options, std::shared_ptr<CheckpointGroup> group);
  ~Checkpointer() = default;  // the saver waits for a pending save

  // Whether maybe_save saves at `step`.
  bool due(int64_t step, bool last_step) const;
  // Saves when due; `state` is called only then. The last step's save is waited for (it is
  // model-only if so configured). Returns whether a save was started.
  bool maybe_save(int64_t step, const StateProvider& state, bool last_step = false);
  // Saves now, async or not as configured. An async save only plans before returning: the state's
  // tensors must stay unmodified until wait_staged() (or wait()) returns.
  void save(int64_t step, const ShardedStateDict& state, const SaveOptions& options = {});
  // Blocks until a pending async save has copied the state out of the live tensors; call it before
  // modifying them (the trainer: before the optimizer step).
  void wait_staged() { saver_.wait_staged(); }
  // Waits for a pending async save; rethrows its error.
  void wait() { saver_.wait(); }

  // Resumes into `dest` from options.load_step, else from the newest usable checkpoint (corrupt
  // ones are skipped). nullopt when the folder holds no checkpoint. Collective.
  std::optional<LoadResult> load(const ShardedStateDict& dest, const LoadOptions& options = {});

  const CheckpointOptions& options() const { return options_; }
  const SaveStats& last_save_stats() const { return saver_.last_stats(); }
  CheckpointGroup& group() { return *group_; }

 private:
  CheckpointOptions options_;
  std::shared_ptr<CheckpointGroup> group_;
  ShardedSaver saver_;
};

}  // namespace loom::checkpoint
