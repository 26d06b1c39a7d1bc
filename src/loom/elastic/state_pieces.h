// Training state held in memory across a change of membership.
//
// A PieceSet is a copy of one rank's pieces of the training state (every chunk of a
// checkpoint::ShardedStateDict: parameters, optimizer state, LR schedule) as bytes on the host,
// with what each chunk is, plus the JSON state (data loader cursor, step). A rank keeps two: its
// own, taken when its membership ends, and, where an FSDP shard has no data-parallel replica, the
// copy of its neighbour's pieces that ShardReplicator refreshes after every step. A new
// membership's trainer is then filled by restore_state from what its members hold, re-sharded to
// its own layout (any layout: the pieces carry their global regions, as checkpoints do).
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#include "loom/checkpoint/state_dict.h"
#include "loom/core/error.h"
#include "loom/distributed/comm.h"

namespace loom::elastic {

// The state of a lost rank has no copy left (or the copies are of different steps): the job
// cannot continue in place. The message is the one line that says why.
class StateLost : public Error {
 public:
  using Error::Error;
};

struct PieceSet {
  int64_t generation = -1;  // the membership the pieces were taken in
  int64_t rank = -1;        // the rank that held them there
  int64_t step = -1;        // the step the state is at; -1: no usable state
  nlohmann::json meta;      // per tensor: name, shape, dtype, chunks (region, byte offset)
  nlohmann::json json;      // the state's global JSON (data loader, step)
  nlohmann::json rank_json;
  torch::Tensor bytes;      // uint8 on the host: every chunk's data, back to back
  bool valid() const { return step >= 0 && bytes.defined(); }
  int64_t nbytes() const { return bytes.defined() ? bytes.numel() : 0; }
};

// What `state`'s chunks are and where each one's bytes go in a PieceSet (its "meta").
nlohmann::json describe_pieces(const checkpoint::ShardedStateDict& state);
int64_t pieces_bytes(const nlohmann::json& meta);
// Copies `state`'s chunks into `bytes` (laid out by describe_pieces(state)).
void copy_pieces(const checkpoint::ShardedStateDict& state, const nlohmann::json& meta, torch::Tensor& bytes);
// A copy of `state`, taken in `generation` by `rank` at `step`.
PieceSet take_pieces(const checkpoint::ShardedStateDict& state, int64_t generation, int64_t rank,
                     int64_t step);

// Keeps a copy of the previous data-parallel rank's pieces (the rank before this one in `group`,
// a ring over the data-parallel ranks that hold different FSDP shards of the same model-parallel
// position): after every step each rank sends its pieces to the next and receives the previous
// one's. What it costs: this rank's state bytes sent and received per step, and the same again in
// host memory.
class ShardReplicator {
 public:
  // `group`: the ring (size >= 2); `world_rank_of`: the world rank of a group rank (PieceSet.rank).
  ShardReplicator(std::shared_ptr<distributed::Comm> group, int64_t generation,
                  std::vector<int64_t> world_ranks);
  // After step `step` was applied: sends this rank's pieces of `state`, receives the previous
  // rank's into `replica` (replaced only once complete).
  void replicate(const checkpoint::ShardedStateDict& state, int64_t step, PieceSet& replica);
  int64_t bytes_sent_per_step() const { return send_.defined() ? send_.numel() : 0; }

 private:
  std::shared_ptr<distributed::Comm> group_;
  int64_t generation_;
  std::vector<int64_t> world_ranks_;
  nlohmann::json meta_;       // this rank's
  nlohmann::json prev_meta_;  // the previous rank's
  torch::Tensor send_;
  torch::Tensor receive_;
  int tag_ = 7001;
};

// Fills `target` (a new membership's live state: views written in place) and its JSON from the
// pieces the members hold (`held`: this rank's, possibly none). Collective over `world`. Only the
// newest membership's pieces count, and all at one step; each region is read from one holder (the
// lowest old rank that had it: replicas hold equal values). Throws StateLost when some region has
// no holder or the holders' steps differ. Returns the step restored.
int64_t restore_state(const std::shared_ptr<distributed::Comm>& world, const std::vector<const PieceSet*>& held,
                      checkpoint::ShardedStateDict& target);

}  // namespace loom::elastic
