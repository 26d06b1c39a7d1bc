// RaggedShard: a tensor's row-major flat range of N elements split across the W ranks of one mesh
// dim by per-rank unit counts. A unit ("granule") is G consecutive flat elements that no layout may
// cut: an element (G = 1), a row (G = product of the trailing dims), a k-row block (G = k rows) or
// the whole tensor (G = N). Rank r holds units [Σ_{q<r} u_q, Σ_{q≤r} u_q), i.e. one contiguous
// flat range, so every layout here is an ordered partition of the flat tensor; ranks may hold zero
// units. DTensor's Shard(0) (and FSDP2's) is the special case G = row, u_r = ceil(rows / W)
// clipped to what is left.
//
// This file is layout math only. The all-to-all plan between two layouts says which flat ranges go
// where; the comm layer executes it.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace loom::tensor {

// Half-open range [begin, end) of flat element indices.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end == begin; }
  friend bool operator==(const FlatRange&, const FlatRange&) = default;
};

// "[4096, 128]" for error messages and reports.
std::string shape_str(const std::vector<int64_t>& shape);

// Product of the dims; `name` appears in the error for a negative dim or an int64 overflow.
int64_t checked_numel(const std::string& name, const std::vector<int64_t>& shape);

// Elements per row: product of dims 1.. (1 for 0-D and 1-D tensors, whose rows are single
// elements, as Shard(0) splits them).
int64_t row_elems(const std::vector<int64_t>& shape);

// The unit a layout must never cut.
struct Granularity {
  // kElementBlock: k consecutive flat elements counted from the tensor's first element (a block of
  // block-wise quantized optimizer state, e.g. AdamW8bit's absmax blocks).
  enum class Kind { kElement, kRow, kRowBlock, kWhole, kElementBlock };
  Kind kind = Kind::kElement;
  int64_t rows_per_block = 1;  // kRowBlock only
  int64_t elems_per_block = 1;  // kElementBlock only

  static Granularity element() { return {Kind::kElement, 1, 1}; }
  static Granularity row() { return {Kind::kRow, 1, 1}; }
  static Granularity row_block(int64_t rows);  // throws for rows < 1
  static Granularity whole() { return {Kind::kWhole, 1, 1}; }
  static Granularity element_block(int64_t elems);  // throws for elems < 1

  // "element", "row", "<k>-row" (k-row block), "<k>-element" (k-element block) or "whole";
  // parse() accepts exactly these.
  std::string str() const;
  static Granularity parse(const std::string& text);

  friend bool operator==(const Granularity&, const Granularity&) = default;
};

// Granule size G in elements of `granularity` on tensor `name` of `shape`. Throws loom::Error naming
// the tensor and sizes when the granularity does not divide the tensor (a k-row block on a tensor
// whose dim 0 is not a multiple of k). A tensor with no elements gets G = 1.
int64_t granule_elems(const Granularity& granularity, const std::string& name,
                      const std::vector<int64_t>& shape);

struct RaggedShard {
  std::vector<int64_t> units_per_rank;  // one entry per rank of the mesh dim
  int64_t granule_elems = 1;            // G

  int64_t world_size() const { return static_cast<int64_t>(units_per_rank.size()); }
  int64_t total_units() const;
  int64_t numel() const { return total_units() * granule_elems; }

  // Throws loom::Error unless the layout is well formed (W ≥ 1, G ≥ 1, units ≥ 0) and covers
  // exactly tensor `name`: G divides its N elements and Σ units × G == N.
  void validate(const std::string& name, const std::vector<int64_t>& shape) const;
  void validate(const std::string& name, int64_t numel) const;

  // Flat range held by `rank` (O(rank)) / by every rank (O(W)).
  FlatRange rank_range(int64_t rank) const;
  std::vector<FlatRange> rank_ranges() const;

  // Shape of `rank`'s local piece when it consists of whole rows: [rows_r, shape[1:]...] (for 1-D
  // and 0-D tensors, whose rows are elements: [elements_r]). nullopt when the range cuts a row.
  std::optional<std::vector<int64_t>> local_shape(int64_t rank,
                                                  const std::vector<int64_t>& global_shape) const;

  // Shard(0)-style even split: ceil(rows / W) rows per rank, the last ranks get the remainder or
  // nothing (torch.chunk semantics, as DTensor and FSDP2 place real rows). A 0-D tensor is one row.
  static RaggedShard shard0(const std::vector<int64_t>& shape, int64_t world_size);
  // Whether this layout puts the same elements on every rank as shard0(shape, W); converting any
  // layout to Shard(0) is plan_redistribute(layout, RaggedShard::shard0(shape, W)).
  bool matches_shard0(const std::vector<int64_t>& shape) const;

  friend bool operator==(const RaggedShard&, const RaggedShard&) = default;
};

// One contiguous piece of an all-to-all: elements [global_begin, global_begin + length) of the flat
// tensor move from src_rank (at src_offset in its local shard) to dst_rank (at dst_offset).
struct TransferChunk {
  int64_t src_rank = 0;
  int64_t dst_rank = 0;
  int64_t global_begin = 0;
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t length = 0;
  friend bool operator==(const TransferChunk&, const TransferChunk&) = default;
};

// Redistribution of one layout into another over the same W ranks. Both layouts order the flat
// tensor by rank, so each (src, dst) pair overlaps in at most one range, there are at most 2W − 1
// chunks, and for every rank its outgoing chunks, taken in dst order, tile its local source shard
// front to back (and its incoming chunks, in src order, tile its destination shard). That is exactly
// the contract of all_to_all_single with send_counts/recv_counts as split sizes: no packing needed.
struct RedistributePlan {
  int64_t world_size = 0;
  std::vector<TransferChunk> chunks;  // non-empty, sorted by global_begin (= by src, then dst)

  // Elements `rank` sends to / receives from each rank (length W; input/output split sizes).
  std::vector<int64_t> send_counts(int64_t rank) const;
  std::vector<int64_t> recv_counts(int64_t rank) const;
  // Elements that change rank (chunks with src_rank != dst_rank).
  int64_t elements_moved() const;
};

// Throws loom::Error when the layouts differ in world size or element count.
RedistributePlan plan_redistribute(const RaggedShard& from, const RaggedShard& to);

// JSON: {"world_size": W, "granule_elems": G, "first_rank": f, "units": [u_f, ..., u_l]} where
// f..l spans the ranks holding units (all others hold none): compact for small tensors on
// thousands of ranks. from_json checks the layout is well formed.
void to_json(nlohmann::json& j, const RaggedShard& shard);
void from_json(const nlohmann::json& j, RaggedShard& shard);
// Granularity as its str() text.
void to_json(nlohmann::json& j, const Granularity& granularity);
void from_json(const nlohmann::json& j, Granularity& granularity);

}  // namespace loom::tensor
