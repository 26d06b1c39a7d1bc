// Where a checkpoint chunk's elements sit in their global tensor. A chunk is a flat range
// [begin, end) of the row-major flattening of an n-D box of the tensor:
//   - FSDP's flat shards and replicated tensors: the box is the whole tensor (stored as no box, the
//     format every earlier checkpoint has), so [begin, end) is a range of the tensor's flattening;
//   - a tensor-parallel shard (Shard(d) on some mesh dim): its box, whole ([0, box numel));
//   - FSDP over a TP shard: the box, and FSDP's flat range within it.
// To copy between two chunks of different layouts, both are cut into runs: maximal pieces that are
// contiguous in the global flattening (one per box row at most, merged where rows touch).
#pragma once
#include <compare>
#include <cstdint>
#include <string>
#include <vector>

namespace loom::checkpoint {

struct Region {
  std::vector<int64_t> box_offsets;  // empty: the whole tensor
  std::vector<int64_t> box_sizes;
  int64_t begin = 0;  // element range of the box's row-major flattening
  int64_t end = 0;

  bool whole_tensor_box() const { return box_offsets.empty(); }
  int64_t numel() const { return end - begin; }
  auto operator<=>(const Region&) const = default;
};

// A piece of a chunk contiguous in the global tensor: `length` elements starting at global flat
// index `global`, found at position `local` of the chunk's data.
struct Run {
  int64_t global = 0;
  int64_t local = 0;
  int64_t length = 0;
};

// The chunk's runs in chunk order (which is also increasing global order).
std::vector<Run> runs_of(const std::vector<int64_t>& shape, const Region& region);

// Empty when `region` is a valid region of a tensor of `shape`, else what is wrong.
std::string region_error(const std::vector<int64_t>& shape, const Region& region);

// "[3, 5)" or "box [0, 4]+[8, 4] elements [3, 5)", for messages.
std::string describe(const Region& region);

}  // namespace loom::checkpoint
