// How a tensor is split across the ranks of a device mesh, dimension by dimension: DTensor's
// placements. On each mesh dimension a tensor is
//   Replicate   every rank of the dim holds all of it;
//   Shard(d)    the ranks hold equal consecutive pieces along tensor dim d, in rank order;
//   Partial     every rank holds a full-shaped addend; the tensor is their sum.
// (FSDP's ragged flat shards are the fourth kind: tensor/ragged_shard.h.) A TensorLayout is the
// global shape plus one placement per mesh dim; from it follow each rank's local shape and the n-D
// box of the global tensor it holds, which is what checkpoints record.
#pragma once
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace loom::tensor {

struct Replicate {
  bool operator==(const Replicate&) const = default;
};
struct Shard {
  int64_t dim = 0;
  bool operator==(const Shard&) const = default;
};
struct Partial {
  bool operator==(const Partial&) const = default;  // a sum; the only reduction TP needs
};
using Placement = std::variant<Replicate, Shard, Partial>;

std::string to_string(const Placement& placement);  // "Replicate", "Shard(1)", "Partial(sum)"

// A region of a tensor: offsets and sizes per tensor dim.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t numel() const;
  bool operator==(const Box&) const = default;
};

// One mesh dim's placement of a tensor, and this rank's place on that dim.
struct MeshDimPlacement {
  std::string mesh_dim;  // "tp", "dp_shard", ...
  Placement placement;
  int rank = 0;  // this rank's index along the mesh dim
  int size = 1;  // ranks along the mesh dim
};

struct TensorLayout {
  std::vector<int64_t> global_shape;
  std::vector<MeshDimPlacement> placements;  // mesh order; Shard dims applied in this order

  // The layout of a tensor nobody splits.
  static TensorLayout replicated(std::vector<int64_t> shape);
  // Throws loom::UsageError when a sharded dim does not divide evenly (TP validates its degrees so
  // that it always does).
  void validate() const;
  // This rank's piece: the global box it holds (a Partial dim does not cut the box).
  Box local_box() const;
  std::vector<int64_t> local_shape() const { return local_box().sizes; }
  bool is_replicated() const;  // every placement Replicate
  std::string describe() const;  // "[4096, 1024] tp:Shard(0)"
};

}  // namespace loom::tensor
