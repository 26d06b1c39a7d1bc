// What a rank hands the checkpointer: its piece of every tensor of the training state, described so
// that any other layout can read it back.
//
// The unit is a chunk: elements [begin, end) of the row-major flattening of the tensor (or of an
// n-D box of it, checkpoint/region.h), with the rank's live data for them. That covers every
// layout Loom has:
//   - FSDP's RaggedShard (a parameter's units on a rank are one flat range; a rank holding several
//     disjoint ranges of a tensor lists several chunks),
//   - Shard(0) (rows r0..r1 are the flat range [r0·row, r1·row)),
//   - replicated tensors (the full range [0, numel) on every holder; the save deduplicates, so
//     identical ranges held by several ranks are written once, by one of them),
//   - tensor-parallel shards (Shard(d): the rank's box), and FSDP over them (a range of the box),
//   - optimizer state, which shares its parameter's layout.
// Chunks are views into live tensors (an FSDP shard, an optimizer moment): a save reads them, a
// load writes into them in place, so views into flat buffers stay views.
//
// Non-tensor state travels as JSON: `json()` is global (rank 0's is saved, every rank gets it back:
// data loader position, LR schedule, config), `rank_json()` is per rank (e.g. RNG state), returned
// on load to the rank with the same index when the checkpoint was saved by that many ranks or more.
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/checkpoint/region.h"

namespace loom::checkpoint {

// Well-known components. `model_only` saves keep only kModelComponent.
inline constexpr const char* kModelComponent = "model";
inline constexpr const char* kOptimizerComponent = "optimizer";

struct LocalChunk {
  int64_t begin = 0;   // first flat element held here: of the global tensor, or of the box
  torch::Tensor data;  // numel() elements in row-major order; any shape, any device
  // An n-D box of the global tensor (checkpoint/region.h) whose flattening `begin` indexes; empty:
  // the whole tensor. A tensor-parallel shard is its box; FSDP over it a flat range of the box.
  std::vector<int64_t> box_offsets = {};
  std::vector<int64_t> box_sizes = {};
  int64_t end() const { return begin + data.numel(); }
  Region region() const { return {box_offsets, box_sizes, begin, end()}; }
};

struct ShardedTensor {
  std::string component;           // "model", "optimizer", "lr_scheduler", ...
  std::vector<int64_t> shape;      // global (unsharded) shape
  c10::ScalarType dtype = c10::kFloat;
  std::vector<LocalChunk> chunks;  // this rank's pieces, disjoint; may be empty
  int64_t numel() const;
};

class ShardedStateDict {
 public:
  // This rank's pieces of tensor `name`. Throws loom::Error when the name is taken or empty, a chunk
  // is undefined, on the meta device, of another dtype, outside [0, numel), or overlaps another.
  ShardedTensor& add_chunks(const std::string& name, const std::string& component,
                            std::vector<int64_t> global_shape, c10::ScalarType dtype,
                            std::vector<LocalChunk> chunks);
  // A tensor this rank holds whole (replicated, or simply unsharded).
  ShardedTensor& add_full(const std::string& name, const std::string& component,
                          const torch::Tensor& tensor);
  // This rank's box of the tensor: `local` is the region [offsets, offsets + local.sizes()) of
  // `global_shape` (a tensor-parallel shard).
  ShardedTensor& add_box(const std::string& name, const std::string& component,
                         std::vector<int64_t> global_shape, std::vector<int64_t> box_offsets,
                         const torch::Tensor& local);
  // This rank's Shard(0) piece: rows [row_offset, row_offset + local.size(0)) of `global_shape`.
  ShardedTensor& add_shard0(const std::string& name, const std::string& component,
                            std::vector<int64_t> global_shape, int64_t row_offset,
                            const torch::Tensor& local);

  const std::map<std::string, ShardedTensor>& tensors() const { return tensors_; }
  bool contains(const std::string& name) const { return tensors_.count(name) > 0; }
  const ShardedTensor& at(const std::string& name) const;

  nlohmann::json& json() { return json_; }
  const nlohmann::json& json() const { return json_; }
  nlohmann::json& rank_json() { return rank_json_; }
  const nlohmann::json& rank_json() const { return rank_json_; }

  // The tensors of one component (JSON state is kept).
  ShardedStateDict only(const std::string& component) const;
  // Bytes of this rank's chunks.
  int64_t local_bytes() const;

 private:
  std::map<std::string, ShardedTensor> tensors_;
  nlohmann::json json_ = nlohmann::json::object();
  nlohmann::json rank_json_ = nlohmann::json::object();
};

}  // namespace loom::checkpoint
