#include "loom/tensor/placement.h"

#include <c10/util/StringUtil.h>

#include "loom/core/error.h"

namespace loom::tensor {

std::string to_string(const Placement& placement) {
  if (std::holds_alternative<Replicate>(placement)) return "Replicate";
  if (const auto* s = std::get_if<Shard>(&placement)) return c10::str("Shard(", s->dim, ")");
  return "Partial(sum)";
}

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

TensorLayout TensorLayout::replicated(std::vector<int64_t> shape) {
  TensorLayout layout;
  layout.global_shape = std::move(shape);
  return layout;
}

void TensorLayout::validate() const {
  std::vector<int64_t> local = global_shape;
  for (const MeshDimPlacement& p : placements) {
    LOOM_REQUIRE(p.size >= 1 && p.rank >= 0 && p.rank < p.size, "mesh dim ", p.mesh_dim,
                 ": rank ", p.rank, " outside its ", p.size, " ranks");
    const auto* shard = std::get_if<Shard>(&p.placement);
    if (shard == nullptr) continue;
    LOOM_REQUIRE(shard->dim >= 0 && shard->dim < static_cast<int64_t>(local.size()), "Shard(",
                 shard->dim, ") on mesh dim ", p.mesh_dim, " of a ", local.size(), "-D tensor");
    LOOM_REQUIRE_USAGE(local[shard->dim] % p.size == 0, "tensor ", describe(), ": dim ",
                       shard->dim, " of size ", local[shard->dim], " does not split evenly over ",
                       p.size, " ranks of mesh dim ", p.mesh_dim);
    local[shard->dim] /= p.size;
  }
}

Box TensorLayout::local_box() const {
  validate();
  Box box{std::vector<int64_t>(global_shape.size(), 0), global_shape};
  // Nested sharding: a later mesh dim splits what the earlier ones left (DTensor's order).
  for (const MeshDimPlacement& p : placements) {
    const auto* shard = std::get_if<Shard>(&p.placement);
    if (shard == nullptr) continue;
    const int64_t piece = box.sizes[shard->dim] / p.size;
    box.offsets[shard->dim] += piece * p.rank;
    box.sizes[shard->dim] = piece;
  }
  return box;
}

bool TensorLayout::is_replicated() const {
  for (const MeshDimPlacement& p : placements) {
    if (!std::holds_alternative<Replicate>(p.placement)) return false;
  }
  return true;
}

std::string TensorLayout::describe() const {
  std::string out = "[";
  for (size_t i = 0; i < global_shape.size(); ++i) out += c10::str(i ? ", " : "", global_shape[i]);
  out += "]";
  for (const MeshDimPlacement& p : placements) out += c10::str(" ", p.mesh_dim, ":", to_string(p.placement));
  return out;
}

}  // namespace loom::tensor
