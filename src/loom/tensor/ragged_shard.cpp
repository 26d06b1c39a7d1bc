#include "loom/tensor/ragged_shard.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>

#include "loom/core/error.h"

namespace loom::tensor {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Multiplies two non-negative int64 values; nullopt on overflow.
std::optional<int64_t> mul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

const nlohmann::json& field(const nlohmann::json& j, const char* key, const char* what) {
  LOOM_REQUIRE(j.is_object(), what, " must be a JSON object, got ", j.type_name());
  auto it = j.find(key);
  LOOM_REQUIRE(it != j.end(), what, " is missing the field '", key, "'");
  return *it;
}

int64_t int_field(const nlohmann::json& j, const char* key, const char* what) {
  const nlohmann::json& v = field(j, key, what);
  LOOM_REQUIRE(v.is_number_integer(), what, " field '", key, "' must be an integer, got ",
               v.dump());
  return v.get<int64_t>();
}

}  // namespace

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

int64_t checked_numel(const std::string& name, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    LOOM_REQUIRE(d >= 0, "tensor '", name, "' has a negative dim in shape ", shape_str(shape),
                 "; fix: dims must be >= 0");
    auto next = mul(n, d);
    LOOM_REQUIRE(next.has_value(), "tensor '", name, "' of shape ", shape_str(shape),
                 " has more than 2^63 elements; fix: check the shape");
    n = *next;
  }
  return n;
}

int64_t row_elems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

Granularity Granularity::row_block(int64_t rows) {
  LOOM_REQUIRE_USAGE(rows >= 1, "a row block needs at least 1 row, got ", rows,
                     "; fix: use a positive block height such as 32");
  return {Kind::kRowBlock, rows, 1};
}

Granularity Granularity::element_block(int64_t elems) {
  LOOM_REQUIRE_USAGE(elems >= 1, "an element block needs at least 1 element, got ", elems,
                     "; fix: use a positive block size such as 256");
  return {Kind::kElementBlock, 1, elems};
}

std::string Granularity::str() const {
  switch (kind) {
    case Kind::kElement: return "element";
    case Kind::kRow: return "row";
    case Kind::kRowBlock: return c10::str(rows_per_block, "-row");
    case Kind::kWhole: return "whole";
    case Kind::kElementBlock: return c10::str(elems_per_block, "-element");
  }
  fail("unknown granularity kind ", static_cast<int>(kind));
}

Granularity Granularity::parse(const std::string& text) {
  if (text == "element") return element();
  if (text == "row") return row();
  if (text == "whole") return whole();
  for (const std::string_view suffix : {std::string_view("-row"), std::string_view("-element")}) {
    if (text.size() <= suffix.size() || !text.ends_with(suffix)) continue;
    int64_t k = 0;
    const char* first = text.data();
    const char* last = text.data() + text.size() - suffix.size();
    auto [ptr, ec] = std::from_chars(first, last, k);
    if (ec == std::errc() && ptr == last && k >= 1) {
      return suffix == "-row" ? row_block(k) : element_block(k);
    }
  }
  fail_usage("unknown granularity '", text,
             "'; fix: use 'element', 'row', '<k>-row' (a block of k rows, e.g. '32-row'), "
             "'<k>-element' (a block of k elements, e.g. '256-element') or 'whole'");
}

int64_t granule_elems(const Granularity& granularity, const std::string& name,
                      const std::vector<int64_t>& shape) {
  const int64_t n = checked_numel(name, shape);
  if (n == 0) return 1;  // nothing to cut
  const int64_t row = row_elems(shape);
  switch (granularity.kind) {
    case Granularity::Kind::kElement: return 1;
    case Granularity::Kind::kRow: return row;
    case Granularity::Kind::kWhole: return n;
    case Granularity::Kind::kRowBlock: {
      const int64_t k = granularity.rows_per_block;
      LOOM_REQUIRE(k >= 1, "tensor '", name, "': a row block needs at least 1 row, got ", k);
      const int64_t rows = shape.empty() ? 1 : shape[0];
      LOOM_REQUIRE(rows % k == 0, "tensor '", name, "' of shape ", shape_str(shape), " (", n,
                   " elements): ", k, "-row blocks do not divide its ", rows,
                   " rows; fix: pick a block height dividing ", rows,
                   " or use 'row'/'element' granularity for this tensor");
      return k * row;
    }
    case Granularity::Kind::kElementBlock: {
      const int64_t k = granularity.elems_per_block;
      LOOM_REQUIRE(k >= 1, "tensor '", name, "': an element block needs at least 1 element, got ", k);
      LOOM_REQUIRE(n % k == 0, "tensor '", name, "' of shape ", shape_str(shape), " (", n,
                   " elements): ", k, "-element blocks do not divide it; fix: pick a block size "
                   "dividing ", n, " or use 'element' granularity for this tensor");
      return k;
    }
  }
  fail("unknown granularity kind ", static_cast<int>(granularity.kind));
}

int64_t RaggedShard::total_units() const {
  int64_t total = 0;
  for (int64_t u : units_per_rank) total += u;
  return total;
}

void RaggedShard::validate(const std::string& name, const std::vector<int64_t>& shape) const {
  validate(name, checked_numel(name, shape));
}

void RaggedShard::validate(const std::string& name, int64_t numel) const {
  LOOM_REQUIRE(!units_per_rank.empty(), "RaggedShard of tensor '", name,
               "' lists no ranks; fix: give one unit count per rank of the mesh dim");
  LOOM_REQUIRE(granule_elems >= 1, "RaggedShard of tensor '", name, "' has granule of ",
               granule_elems, " elements; fix: the granule must be >= 1 element");
  LOOM_REQUIRE(numel % granule_elems == 0, "granule of ", granule_elems,
               " elements does not divide tensor '", name, "' of ", numel,
               " elements; fix: choose a granularity whose size divides the tensor");
  int64_t total = 0;
  for (size_t r = 0; r < units_per_rank.size(); ++r) {
    const int64_t u = units_per_rank[r];
    LOOM_REQUIRE(u >= 0, "RaggedShard of tensor '", name, "' gives rank ", r, " ", u,
                 " units; fix: unit counts must be >= 0");
    LOOM_REQUIRE(!__builtin_add_overflow(total, u, &total), "RaggedShard of tensor '", name,
                 "': unit counts overflow int64");
  }
  const auto covered = mul(total, granule_elems);
  LOOM_REQUIRE(covered.has_value() && *covered == numel, "RaggedShard of tensor '", name,
               "' covers ", total, " units x ", granule_elems, " elements but the tensor has ",
               numel, " elements; fix: per-rank units must sum to ", numel / granule_elems);
}

FlatRange RaggedShard::rank_range(int64_t rank) const {
  LOOM_REQUIRE(rank >= 0 && rank < world_size(), "rank ", rank, " is outside a RaggedShard over ",
               world_size(), " ranks");
  int64_t begin = 0;
  for (int64_t r = 0; r < rank; ++r) begin += units_per_rank[r];
  return {begin * granule_elems, (begin + units_per_rank[rank]) * granule_elems};
}

std::vector<FlatRange> RaggedShard::rank_ranges() const {
  std::vector<FlatRange> out;
  out.reserve(units_per_rank.size());
  int64_t begin = 0;
  for (int64_t u : units_per_rank) {
    out.push_back({begin * granule_elems, (begin + u) * granule_elems});
    begin += u;
  }
  return out;
}

std::optional<std::vector<int64_t>> RaggedShard::local_shape(
    int64_t rank, const std::vector<int64_t>& global_shape) const {
  const FlatRange range = rank_range(rank);
  if (global_shape.size() <= 1) return std::vector<int64_t>{range.size()};
  const int64_t row = row_elems(global_shape);
  std::vector<int64_t> shape = global_shape;
  if (row == 0) {
    // No elements, so the flat range says nothing about rows: report torch.chunk's row split.
    const int64_t chunk = ceil_div(global_shape[0], world_size());
    shape[0] = std::clamp<int64_t>(global_shape[0] - rank * chunk, 0, chunk);
    return shape;
  }
  if (range.begin % row != 0 || range.end % row != 0) return std::nullopt;
  shape[0] = range.size() / row;
  return shape;
}

RaggedShard RaggedShard::shard0(const std::vector<int64_t>& shape, int64_t world_size) {
  LOOM_REQUIRE_USAGE(world_size >= 1, "Shard(0) over ", world_size,
                     " ranks; fix: the mesh dim needs at least 1 rank");
  const int64_t rows = shape.empty() ? 1 : shape[0];
  const int64_t row = row_elems(shape);
  RaggedShard out;
  // A tensor without elements still needs a granule >= 1; its rows then hold zero elements each.
  out.granule_elems = row == 0 ? 1 : row;
  out.units_per_rank.assign(static_cast<size_t>(world_size), 0);
  if (row == 0) return out;
  const int64_t chunk = ceil_div(rows, world_size);
  int64_t left = rows;
  for (auto& u : out.units_per_rank) {
    u = std::min(chunk, left);
    left -= u;
  }
  return out;
}

bool RaggedShard::matches_shard0(const std::vector<int64_t>& shape) const {
  return rank_ranges() == shard0(shape, world_size()).rank_ranges();
}

std::vector<int64_t> RedistributePlan::send_counts(int64_t rank) const {
  std::vector<int64_t> out(static_cast<size_t>(world_size), 0);
  for (const auto& c : chunks) {
    if (c.src_rank == rank) out[c.dst_rank] += c.length;
  }
  return out;
}

std::vector<int64_t> RedistributePlan::recv_counts(int64_t rank) const {
  std::vector<int64_t> out(static_cast<size_t>(world_size), 0);
  for (const auto& c : chunks) {
    if (c.dst_rank == rank) out[c.src_rank] += c.length;
  }
  return out;
}

int64_t RedistributePlan::elements_moved() const {
  int64_t moved = 0;
  for (const auto& c : chunks) {
    if (c.src_rank != c.dst_rank) moved += c.length;
  }
  return moved;
}

RedistributePlan plan_redistribute(const RaggedShard& from, const RaggedShard& to) {
  LOOM_REQUIRE(from.world_size() == to.world_size(), "cannot redistribute a RaggedShard over ",
               from.world_size(), " ranks into one over ", to.world_size(),
               " ranks; fix: both layouts must span the same mesh dim");
  from.validate("<redistribute source>", from.numel());
  to.validate("<redistribute target>", to.numel());
  LOOM_REQUIRE(from.numel() == to.numel(), "cannot redistribute ", from.numel(),
               " elements into a layout of ", to.numel(),
               " elements; fix: both layouts must describe the same tensor");
  const std::vector<FlatRange> src = from.rank_ranges();
  const std::vector<FlatRange> dst = to.rank_ranges();
  RedistributePlan plan;
  plan.world_size = from.world_size();
  // Two-pointer sweep over both ordered partitions of [0, N): each step emits the overlap of the
  // current source and destination ranges and advances whichever ends first.
  size_t s = 0;
  size_t d = 0;
  while (s < src.size() && d < dst.size()) {
    if (src[s].empty()) { ++s; continue; }
    if (dst[d].empty()) { ++d; continue; }
    const int64_t begin = std::max(src[s].begin, dst[d].begin);
    const int64_t end = std::min(src[s].end, dst[d].end);
    if (begin < end) {
      plan.chunks.push_back({static_cast<int64_t>(s), static_cast<int64_t>(d), begin,
                             begin - src[s].begin, begin - dst[d].begin, end - begin});
    }
    if (src[s].end <= dst[d].end) ++s; else ++d;
  }
  return plan;
}

void to_json(nlohmann::json& j, const RaggedShard& shard) {
  int64_t first = 0;
  int64_t last = -1;
  for (int64_t r = 0; r < shard.world_size(); ++r) {
    if (shard.units_per_rank[r] == 0) continue;
    if (last < 0) first = r;
    last = r;
  }
  j = nlohmann::json{{"world_size", shard.world_size()},
                     {"granule_elems", shard.granule_elems},
                     {"first_rank", first},
                     {"units", std::vector<int64_t>(shard.units_per_rank.begin() + first,
                                                    shard.units_per_rank.begin() + last + 1)}};
}

void from_json(const nlohmann::json& j, RaggedShard& shard) {
  constexpr const char* kWhat = "RaggedShard JSON";
  const int64_t world = int_field(j, "world_size", kWhat);
  const int64_t granule = int_field(j, "granule_elems", kWhat);
  const int64_t first = int_field(j, "first_rank", kWhat);
  const nlohmann::json& units = field(j, "units", kWhat);
  LOOM_REQUIRE(world >= 1 && granule >= 1, kWhat, " needs world_size >= 1 and granule_elems >= 1, got ",
               world, " and ", granule);
  LOOM_REQUIRE(units.is_array(), kWhat, " field 'units' must be an array");
  const auto count = static_cast<int64_t>(units.size());
  LOOM_REQUIRE(first >= 0 && first + count <= world, kWhat, " places ", count,
               " unit counts from rank ", first, " on ", world, " ranks");
  shard.granule_elems = granule;
  shard.units_per_rank.assign(static_cast<size_t>(world), 0);
  for (int64_t i = 0; i < count; ++i) {
    LOOM_REQUIRE(units[i].is_number_integer() && units[i].get<int64_t>() >= 0, kWhat,
                 " unit count ", units[i].dump(), " must be a non-negative integer");
    shard.units_per_rank[first + i] = units[i].get<int64_t>();
  }
}

void to_json(nlohmann::json& j, const Granularity& granularity) { j = granularity.str(); }

void from_json(const nlohmann::json& j, Granularity& granularity) {
  LOOM_REQUIRE(j.is_string(), "granularity must be a JSON string, got ", j.dump());
  granularity = Granularity::parse(j.get<std::string>());
}

}  // namespace loom::tensor
