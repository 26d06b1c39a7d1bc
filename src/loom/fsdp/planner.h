// Structure-aware layout planner for one FSDP group (after veScale-FSDP). The group's tensors live
// in one flat buffer of W·S elements; rank r owns the slice [r·S, (r+1)·S). The planner picks the
// per-rank shard size S and each tensor's place so that
//   (a) no granule (element, row, k-row block or whole tensor, per tensor) straddles a rank
//       boundary, so block-wise quantization and matrix optimizers see whole units locally;
//   (b) S · dtype_bytes is a multiple of the alignment (16 bytes: NCCL-friendly);
//   (c) S is as small as the heuristic can make it (see docs/fsdp_planner.md).
// Each tensor's share of every rank is then a tensor::RaggedShard. The Plan is plain data recorded
// as JSON so checkpoints and optimizers can see the layout.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "loom/tensor/ragged_shard.h"

namespace loom::fsdp {

// One parameter of an FSDP group, in module order.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t dtype_bytes = 4;  // every tensor of a group shares one dtype (one flat buffer)
  tensor::Granularity granularity = tensor::Granularity::element();
};

struct GroupSpec {
  std::string name;  // e.g. "layers.3" or "root"
  std::vector<TensorSpec> tensors;
};

struct PlannerOptions {
  int64_t alignment_bytes = 16;  // per-rank shard bytes are a multiple of this
  bool try_reorder = true;       // also try the non-module tensor orders below
};

// The order tensors are laid out in the flat buffer.
enum class TensorOrder {
  kModule,            // as given: keeps the buffer in module order for prefetch locality
  kGranuleDescending, // largest granule first (stable)
  kGranularityClass,  // whole tensors, then row blocks, then rows, then elements (stable)
};
std::string to_string(TensorOrder order);
TensorOrder tensor_order_from_string(const std::string& text);

// One tensor's place in the group's flat buffer. Its units are laid out in flat order over ranks
// first_rank..last_rank: on the first it starts at `offset − first_rank·S`, on the following ones at
// local offset 0. Padding may sit between its pieces (a granule that would straddle a boundary is
// moved to the next rank), so the tensor is one contiguous run of the unsharded buffer only when
// Plan::contiguous says so.
struct TensorLayout {
  std::string name;
  std::vector<int64_t> shape;
  tensor::Granularity granularity;
  int64_t numel = 0;
  int64_t offset = 0;         // flat index of its first element in the W·S buffer
  tensor::RaggedShard shard;  // units per rank, granule = shard.granule_elems
  friend bool operator==(const TensorLayout&, const TensorLayout&) = default;
};

struct Plan {
  std::string group;
  int64_t world_size = 0;       // W
  int64_t shard_elems = 0;      // S
  int64_t dtype_bytes = 0;
  int64_t alignment_bytes = 0;
  TensorOrder order = TensorOrder::kModule;
  std::vector<TensorLayout> tensors;  // module order (as given), whatever the buffer order

  int64_t buffer_elems() const { return world_size * shard_elems; }  // W·S
  int64_t shard_bytes() const { return shard_elems * dtype_bytes; }
  int64_t total_numel() const;                                        // Σ numel
  int64_t padding_elems() const { return buffer_elems() - total_numel(); }
  double padding_fraction() const;  // (W·S − Σ numel) / (W·S)
  // FSDP2 Shard(0) for comparison: each tensor's dim 0 padded to a multiple of W.
  int64_t shard0_buffer_elems() const;
  int64_t shard0_padding_elems() const { return shard0_buffer_elems() - total_numel(); }
  double shard0_padding_fraction() const;

  // Where tensor i's units sit inside rank `rank`'s shard of S elements (empty when it holds none).
  tensor::FlatRange local_range(size_t tensor_index, int64_t rank) const;
  // Whether tensor i occupies [offset, offset + numel) of the unsharded buffer without a gap, so
  // its unsharded parameter can be a view of the all-gathered buffer.
  bool contiguous(size_t tensor_index) const;
  // Tensor indices in buffer (offset) order.
  std::vector<size_t> buffer_order() const;

  friend bool operator==(const Plan&, const Plan&) = default;
};

// Elements FSDP2 allocates for one tensor sharded Shard(0) over W ranks: ceil(dim0 / W) · W rows
// (a 0-D tensor is one row of one element).
int64_t shard0_padded_numel(const std::vector<int64_t>& shape, int64_t world_size);

// Plans one group. Deterministic: the same input gives the same Plan. Throws loom::Error for bad
// input (no tensors, W < 1, a granularity that does not divide its tensor, mixed dtypes, duplicate
// names, a buffer beyond int64).
Plan plan_group(const GroupSpec& group, int64_t world_size, const PlannerOptions& options = {});
std::vector<Plan> plan_groups(const std::vector<GroupSpec>& groups, int64_t world_size,
                              const PlannerOptions& options = {});

// Checks every invariant of a plan (granules inside one rank, no two tensors overlapping, units
// covering each tensor, S aligned, buffer within int64); throws loom::Error naming the first
// violation. plan_from_json runs it, so a loaded plan is as trustworthy as a fresh one.
void validate_plan(const Plan& plan);

// JSON schema "loom.fsdp.plan/1": the plan's fields plus an informational "summary" (padding);
// the summary is recomputed, never read back.
nlohmann::json plan_to_json(const Plan& plan);
Plan plan_from_json(const nlohmann::json& j);

}  // namespace loom::fsdp
