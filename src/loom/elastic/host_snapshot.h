// A rank's copy of its training state in host shared memory (/dev/shm), refreshed after every step:
// it outlives the rank's process, so when a rank dies the survivors on its host read its FSDP shard
// from there -- the copy an FSDP shard without a data-parallel replica needs. What it costs: one
// host memcpy of the rank's state per step (no transfer), and twice that state in host memory (two
// slots: a rank killed while writing one leaves the other, the step before, whole). A dead host
// takes its copies with it: across hosts ShardReplicator's neighbour copy is the one that survives
// (fault_tolerance.shard_copy).
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "loom/checkpoint/state_dict.h"
#include "loom/elastic/state_pieces.h"

namespace loom::elastic {

class HostSnapshot {
 public:
  // The file of `member` in job `job` (a name unique to the launch: its store port and attempt).
  static std::filesystem::path path_of(const std::string& job, int64_t member);

  HostSnapshot(const std::string& job, int64_t member);
  ~HostSnapshot();
  HostSnapshot(const HostSnapshot&) = delete;
  HostSnapshot& operator=(const HostSnapshot&) = delete;

  // After step `step` of generation `generation` (where this member is `rank`): writes `state`
  // into the older slot, then makes it the newest.
  void write(const checkpoint::ShardedStateDict& state, int64_t generation, int64_t rank, int64_t step);

 private:
  void map(int64_t slot_bytes, int64_t meta_capacity);
  std::filesystem::path path_;
  int fd_ = -1;
  void* base_ = nullptr;
  int64_t size_ = 0;
  int64_t slot_bytes_ = 0;
  int64_t meta_capacity_ = 0;
  int64_t generation_ = -1;
  nlohmann::json meta_;
  std::string meta_text_;
};

// The complete slots of a member's file: (generation, rank, step) each. Empty when there is none.
struct SnapshotSlot {
  int64_t generation = -1;
  int64_t rank = -1;
  int64_t step = -1;
};
std::vector<SnapshotSlot> read_snapshot_slots(const std::filesystem::path& file);
// That slot's pieces (bytes copied out of the file). nullopt when the file has no slot at `step`.
std::optional<PieceSet> read_snapshot(const std::filesystem::path& file, int64_t step);

}  // namespace loom::elastic
