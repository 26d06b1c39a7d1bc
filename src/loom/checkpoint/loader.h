// Load with resharding: the destination is the *current* layout's ShardedStateDict (views into live
// tensors); for each of its chunks the loader copies the overlapping parts of the saved chunks,
// whatever layout and world size saved them. So a checkpoint saved at FSDP 4 loads at FSDP 2, at
// HSDP 2x2 or in one process. Only the saved chunks that overlap a destination chunk are read
// (through a memory map), and each one's CRC-32C is checked once before any of it is used; a
// corrupt or truncated file is a CorruptCheckpointError naming it, never a silent load.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/checkpoint/group.h"
#include "loom/core/error.h"
#include "loom/checkpoint/state_dict.h"

namespace loom::checkpoint {

struct LoadOptions {
  // Every destination tensor must be in the checkpoint; false skips missing ones (listed in
  // LoadResult::missing), e.g. to initialise a model from a model-only checkpoint.
  bool strict = true;
  // Resuming training: a model-only checkpoint (checkpoint.model_only's last save) holds no
  // optimizer or trainer state, so load_latest passes over it to the newest full checkpoint, and
  // load_checkpoint refuses it with ModelOnlyCheckpointError.
  bool skip_model_only = false;
  // load_latest logs the checkpoint it loaded (info, on stdout). Commands whose stdout is their
  // result (`loom generate --ids`, `loom score`) turn it off; warnings about skipped ones stay.
  bool log_loaded = true;
  // Called with the checkpoint's folder and saved global JSON state before any tensor is read; it
  // throws (a loom::UsageError) to refuse the checkpoint, so a setting that does not fit it (LoRA's
  // rank, its base) is named rather than the first tensor whose shape differs. Not a reason to
  // fall back to an older step: load_latest lets what it throws through.
  std::function<void(const std::filesystem::path& dir, const nlohmann::json& state)> check_state;
};

// A model-only checkpoint where full training state was asked for (LoadOptions::skip_model_only).
class ModelOnlyCheckpointError : public Error {
 public:
  using Error::Error;
};

struct LoadResult {
  int64_t step = 0;
  std::filesystem::path path;
  int saved_world_size = 1;
  bool model_only = false;
  nlohmann::json json = nlohmann::json::object();  // the saved global JSON state
  // This rank's saved per-rank JSON; nullopt when the checkpoint was saved by fewer ranks.
  std::optional<nlohmann::json> rank_json;
  std::vector<std::string> missing;  // destination tensors absent from the checkpoint (non-strict)
  int64_t bytes_read = 0;            // saved chunk bytes read (and checksummed) by this rank
};

// Loads checkpoint directory `dir` (…/step-N, which must be complete) into `dest` in place, as
// rank `rank`. No communication. Throws CorruptCheckpointError for a damaged checkpoint and
// loom::Error when it does not fit `dest` (missing tensor, other global shape).
LoadResult load_checkpoint(const std::filesystem::path& dir, const ShardedStateDict& dest,
                           int rank = 0, const LoadOptions& options = {});

// The newest complete checkpoint in `folder` that loads on every rank (collective). A checkpoint
// any rank finds corrupt is skipped on all ranks, with a warning naming the file, for the previous
// one; so is a model-only one under skip_model_only (UsageError when nothing else is left). nullopt
// when the folder holds none. A checkpoint that does not fit `dest` is an error on
// every rank. `dest` may have been partly overwritten by a skipped checkpoint: on success every
// destination chunk comes from the one returned.
std::optional<LoadResult> load_latest(const std::filesystem::path& folder,
                                      const ShardedStateDict& dest, CheckpointGroup& group,
                                      const LoadOptions& options = {});

// Loads step `step` of `folder` on every rank (collective); any rank's failure fails all ranks.
LoadResult load_step(const std::filesystem::path& folder, int64_t step,
                     const ShardedStateDict& dest, CheckpointGroup& group,
                     const LoadOptions& options = {});

}  // namespace loom::checkpoint
