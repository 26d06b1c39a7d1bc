// The few collectives the checkpointer needs, behind a small interface so checkpoint code does not
// depend on the comm layer beyond them (and tests can simulate several ranks with threads).
// They are only ever called from the training thread, in the same order on every rank; the
// background writer of an async save never communicates (ranks report completion through files).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace loom::distributed {
class Comm;
}

namespace loom::checkpoint {

class CheckpointGroup {
 public:
  virtual ~CheckpointGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank's `bytes`, indexed by rank.
  virtual std::vector<std::string> all_gather(const std::string& bytes) = 0;
  // The maximum of every rank's `value`.
  virtual int64_t all_reduce_max(int64_t value) = 0;
  virtual void barrier() { all_reduce_max(0); }
};

// Rank 0 of 1: every collective is local.
std::shared_ptr<CheckpointGroup> single_process_group();

// Over a Loom communicator (normally the world). Gathers run as two all_gathers (lengths, then
// bytes padded to the longest) on CPU tensors, so they work with Gloo and are counted by CommStats.
std::shared_ptr<CheckpointGroup> comm_group(std::shared_ptr<distributed::Comm> comm);

}  // namespace loom::checkpoint
