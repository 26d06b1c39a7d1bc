#include "loom/fsdp/planner.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <numeric>
#include <unordered_set>

#include "loom/core/error.h"

namespace loom::fsdp {

namespace {

using tensor::FlatRange;
using tensor::Granularity;

constexpr const char* kPlanFormat = "loom.fsdp.plan/1";

// What the search needs of a tensor: its granule size and how many granules it has.
struct Item {
  int64_t granule = 1;
  int64_t units = 0;
};

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// Smallest multiple of `align` that is >= value (value >= 0); throws past int64.
int64_t round_up(int64_t value, int64_t align, const std::string& group) {
  const int64_t rem = value % align;
  int64_t out = value;
  LOOM_REQUIRE(rem == 0 || !__builtin_add_overflow(value, align - rem, &out), "FSDP group '",
               group, "' needs a shard of more than 2^63 elements; fix: split the group");
  return out;
}

// Greedy feasibility check for shard size S: walk the tensors in `order`, packing granules into
// the current rank; a granule that would straddle the rank's end starts the next rank instead (the
// rest of the rank is padding). Feasible iff it needs at most W ranks. A tensor spanning many ranks
// is handled in O(1): after topping up the current rank, its remaining granules fill fresh ranks at
// floor(S / G) each. So one check is O(T) for T tensors, independent of W.
bool fits(const std::vector<Item>& items, const std::vector<size_t>& order, int64_t world_size,
          int64_t shard) {
  int64_t rank = 0;
  int64_t fill = 0;
  for (size_t idx : order) {
    const Item& item = items[idx];
    if (item.units == 0) continue;
    if (item.granule > shard) return false;
    const int64_t fit = (shard - fill) / item.granule;
    if (fit >= item.units) {
      fill += item.units * item.granule;
      continue;
    }
    const int64_t left = item.units - fit;  // granules for fresh ranks
    const int64_t per_rank = shard / item.granule;
    const int64_t fresh = ceil_div(left, per_rank);
    if (fresh >= world_size - rank) return false;
    rank += fresh;
    fill = (left - (fresh - 1) * per_rank) * item.granule;
  }
  return true;
}

// Smallest feasible multiple of `align` in [lower, upper] for this order, given that `upper` is
// feasible. Feasibility is monotone in S (a placement valid for S is valid for any larger S: the
// greedy packs an ordered sequence into consecutive ranks, like the linear-partition problem), so
// doubling from the lower bound and then bisecting finds the minimum in O(log(S/lower)) checks.
int64_t minimal_shard(const std::vector<Item>& items, const std::vector<size_t>& order,
                      int64_t world_size, int64_t align, int64_t lower, int64_t upper) {
  if (fits(items, order, world_size, lower)) return lower;
  int64_t bad = lower;
  int64_t good = upper;
  for (int64_t probe = lower; probe < upper;) {
    probe = probe > upper / 2 ? upper : probe * 2;  // multiples of align stay multiples
    if (fits(items, order, world_size, probe)) {
      good = probe;
      break;
    }
    bad = probe;
  }
  while (good - bad > align) {
    const int64_t mid = bad + (good - bad) / align / 2 * align;
    if (fits(items, order, world_size, mid)) good = mid; else bad = mid;
  }
  return good;
}

int granularity_class(const Granularity& g) {
  switch (g.kind) {
    case Granularity::Kind::kWhole: return 0;
    case Granularity::Kind::kRowBlock:
    case Granularity::Kind::kElementBlock: return 1;
    case Granularity::Kind::kRow: return 2;
    case Granularity::Kind::kElement: return 3;
  }
  return 4;
}

std::vector<size_t> make_order(TensorOrder kind, const std::vector<Item>& items,
                               const std::vector<TensorSpec>& specs) {
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), size_t{0});
  switch (kind) {
    case TensorOrder::kModule: break;
    case TensorOrder::kGranuleDescending:
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return items[a].granule > items[b].granule; });
      break;
    case TensorOrder::kGranularityClass:
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return granularity_class(specs[a].granularity) < granularity_class(specs[b].granularity);
      });
      break;
  }
  return order;
}

// Runs the greedy for the chosen S once more, recording where every tensor lands.
void place(const std::vector<Item>& items, const std::vector<size_t>& order, int64_t world_size,
           int64_t shard, std::vector<TensorLayout>& layouts) {
  int64_t rank = 0;
  int64_t fill = 0;
  for (size_t idx : order) {
    const Item& item = items[idx];
    TensorLayout& layout = layouts[idx];
    layout.shard.granule_elems = item.granule;
    layout.shard.units_per_rank.assign(static_cast<size_t>(world_size), 0);
    layout.offset = rank * shard + fill;
    bool started = false;
    int64_t left = item.units;
    while (left > 0) {
      const int64_t fit = (shard - fill) / item.granule;
      if (fit == 0) {
        ++rank;
        fill = 0;
        TORCH_INTERNAL_ASSERT(rank < world_size, "planner placed past the last rank");
        continue;
      }
      if (!started) {
        layout.offset = rank * shard + fill;
        started = true;
      }
      const int64_t take = std::min(fit, left);
      layout.shard.units_per_rank[rank] += take;
      fill += take * item.granule;
      left -= take;
    }
  }
}

// Calls fn(rank, local_begin, length) for each rank holding units of `layout`, in rank order: the
// first such rank holds them from offset − rank·S, later ranks from 0 (see TensorLayout).
template <typename Fn>
void for_each_piece(const TensorLayout& layout, int64_t shard, Fn&& fn) {
  bool first = true;
  for (int64_t r = 0; r < layout.shard.world_size(); ++r) {
    const int64_t u = layout.shard.units_per_rank[r];
    if (u == 0) continue;
    const int64_t begin = first ? layout.offset - r * shard : 0;
    first = false;
    fn(r, begin, u * layout.shard.granule_elems);
  }
}

const nlohmann::json& field(const nlohmann::json& j, const char* key) {
  LOOM_REQUIRE(j.is_object(), "FSDP plan JSON: expected an object holding '", key, "', got ",
               j.type_name());
  auto it = j.find(key);
  LOOM_REQUIRE(it != j.end(), "FSDP plan JSON is missing the field '", key, "'");
  return *it;
}

}  // namespace

std::string to_string(TensorOrder order) {
  switch (order) {
    case TensorOrder::kModule: return "module";
    case TensorOrder::kGranuleDescending: return "granule_descending";
    case TensorOrder::kGranularityClass: return "granularity_class";
  }
  fail("unknown tensor order ", static_cast<int>(order));
}

TensorOrder tensor_order_from_string(const std::string& text) {
  for (TensorOrder o : {TensorOrder::kModule, TensorOrder::kGranuleDescending,
                        TensorOrder::kGranularityClass}) {
    if (text == to_string(o)) return o;
  }
  fail("unknown tensor order '", text,
       "'; fix: use 'module', 'granule_descending' or 'granularity_class'");
}

int64_t Plan::total_numel() const {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel;
  return total;
}

double Plan::padding_fraction() const {
  const int64_t buffer = buffer_elems();
  return buffer == 0 ? 0.0 : static_cast<double>(padding_elems()) / static_cast<double>(buffer);
}

int64_t Plan::shard0_buffer_elems() const {
  int64_t total = 0;
  for (const auto& t : tensors) total += shard0_padded_numel(t.shape, world_size);
  return total;
}

double Plan::shard0_padding_fraction() const {
  const int64_t buffer = shard0_buffer_elems();
  return buffer == 0 ? 0.0
                     : static_cast<double>(shard0_padding_elems()) / static_cast<double>(buffer);
}

FlatRange Plan::local_range(size_t tensor_index, int64_t rank) const {
  LOOM_REQUIRE(tensor_index < tensors.size(), "tensor index ", tensor_index, " is outside group '",
               group, "' of ", tensors.size(), " tensors");
  LOOM_REQUIRE(rank >= 0 && rank < world_size, "rank ", rank, " is outside group '", group,
               "' sharded over ", world_size, " ranks");
  FlatRange out;
  for_each_piece(tensors[tensor_index], shard_elems, [&](int64_t r, int64_t begin, int64_t len) {
    if (r == rank) out = {begin, begin + len};
  });
  return out;
}

bool Plan::contiguous(size_t tensor_index) const {
  LOOM_REQUIRE(tensor_index < tensors.size(), "tensor index ", tensor_index, " is outside group '",
               group, "' of ", tensors.size(), " tensors");
  const TensorLayout& t = tensors[tensor_index];
  int64_t expected = t.offset;  // global position where the next piece must start
  bool ok = true;
  for_each_piece(t, shard_elems, [&](int64_t r, int64_t begin, int64_t len) {
    ok = ok && r * shard_elems + begin == expected;
    expected = r * shard_elems + begin + len;
  });
  return ok;
}

std::vector<size_t> Plan::buffer_order() const {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return tensors[a].offset < tensors[b].offset; });
  return order;
}

int64_t shard0_padded_numel(const std::vector<int64_t>& shape, int64_t world_size) {
  LOOM_REQUIRE_USAGE(world_size >= 1, "Shard(0) over ", world_size,
                     " ranks; fix: the mesh dim needs at least 1 rank");
  const int64_t rows = shape.empty() ? 1 : shape[0];
  return ceil_div(rows, world_size) * world_size * tensor::row_elems(shape);
}

Plan plan_group(const GroupSpec& group, int64_t world_size, const PlannerOptions& options) {
  const std::string& g = group.name;
  LOOM_REQUIRE_USAGE(world_size >= 1, "FSDP group '", g, "': shard-group size must be >= 1, got ",
                     world_size, "; fix: pass the data-parallel shard degree");
  LOOM_REQUIRE(!group.tensors.empty(), "FSDP group '", g,
               "' has no tensors; fix: drop the group or give it parameters");
  LOOM_REQUIRE_USAGE(options.alignment_bytes >= 1, "FSDP planner alignment must be >= 1 byte, got ",
                     options.alignment_bytes);
  const int64_t dtype_bytes = group.tensors.front().dtype_bytes;
  std::vector<Item> items;
  items.reserve(group.tensors.size());
  std::unordered_set<std::string> names;
  int64_t total = 0;
  int64_t max_granule = 1;
  for (const TensorSpec& t : group.tensors) {
    LOOM_REQUIRE(names.insert(t.name).second, "tensor '", t.name, "' appears twice in FSDP group '",
                 g, "'; fix: give each parameter one entry");
    LOOM_REQUIRE(t.dtype_bytes >= 1, "tensor '", t.name, "' in FSDP group '", g,
                 "' has dtype size ", t.dtype_bytes, " bytes; fix: pass the element size (>= 1)");
    LOOM_REQUIRE(t.dtype_bytes == dtype_bytes, "FSDP group '", g, "' mixes ", dtype_bytes,
                 "-byte and ", t.dtype_bytes, "-byte tensors ('", t.name,
                 "'); fix: one flat buffer holds one dtype, put other dtypes in their own group");
    const int64_t numel = tensor::checked_numel(t.name, t.shape);
    const int64_t granule = tensor::granule_elems(t.granularity, t.name, t.shape);
    LOOM_REQUIRE(!__builtin_add_overflow(total, numel, &total), "FSDP group '", g,
                 "' holds more than 2^63 elements; fix: split the group");
    items.push_back({granule, numel / granule});
    max_granule = std::max(max_granule, granule);
  }

  const int64_t align = options.alignment_bytes / std::gcd(options.alignment_bytes, dtype_bytes);
  // Lower bound: the elements must fit in W shards and the largest granule in one shard.
  const int64_t lower = round_up(std::max(ceil_div(total, world_size), max_granule), align, g);
  // Everything on rank 0 always fits, so S = total (aligned) is a feasible upper bound.
  const int64_t upper = std::max(lower, round_up(total, align, g));

  std::vector<TensorOrder> kinds{TensorOrder::kModule};
  if (options.try_reorder) {
    kinds.push_back(TensorOrder::kGranuleDescending);
    kinds.push_back(TensorOrder::kGranularityClass);
  }
  std::vector<std::vector<size_t>> tried;
  TensorOrder best_kind = TensorOrder::kModule;
  std::vector<size_t> best_order;
  int64_t best = 0;
  for (TensorOrder kind : kinds) {
    std::vector<size_t> order = make_order(kind, items, group.tensors);
    if (std::find(tried.begin(), tried.end(), order) != tried.end()) continue;
    tried.push_back(order);
    if (best_order.empty()) {
      best = minimal_shard(items, order, world_size, align, lower, upper);
      best_kind = kind;
      best_order = std::move(order);
      continue;
    }
    // A later order replaces the current best only when strictly smaller (ties keep the earlier
    // order, module order first); a single check at best − align rules most orders out.
    if (best == lower || !fits(items, order, world_size, best - align)) continue;
    best = minimal_shard(items, order, world_size, align, lower, best - align);
    best_kind = kind;
    best_order = std::move(order);
  }

  int64_t buffer_elems = 0;
  int64_t shard_bytes = 0;
  LOOM_REQUIRE(!__builtin_mul_overflow(world_size, best, &buffer_elems), "FSDP group '", g,
               "': a buffer of ", world_size, " x ", best,
               " elements exceeds int64; fix: split the group or shard over fewer ranks");
  LOOM_REQUIRE(!__builtin_mul_overflow(best, dtype_bytes, &shard_bytes), "FSDP group '", g,
               "': a shard of ", best, " elements x ", dtype_bytes,
               " bytes exceeds int64; fix: split the group");

  Plan plan;
  plan.group = g;
  plan.world_size = world_size;
  plan.shard_elems = best;
  plan.dtype_bytes = dtype_bytes;
  plan.alignment_bytes = options.alignment_bytes;
  plan.order = best_kind;
  plan.tensors.resize(group.tensors.size());
  for (size_t i = 0; i < group.tensors.size(); ++i) {
    const TensorSpec& t = group.tensors[i];
    TensorLayout& layout = plan.tensors[i];
    layout.name = t.name;
    layout.shape = t.shape;
    layout.granularity = t.granularity;
    layout.numel = items[i].units * items[i].granule;
  }
  place(items, best_order, world_size, best, plan.tensors);
  return plan;
}

std::vector<Plan> plan_groups(const std::vector<GroupSpec>& groups, int64_t world_size,
                              const PlannerOptions& options) {
  std::vector<Plan> plans;
  plans.reserve(groups.size());
  for (const GroupSpec& group : groups) plans.push_back(plan_group(group, world_size, options));
  return plans;
}

void validate_plan(const Plan& plan) {
  const std::string& g = plan.group;
  LOOM_REQUIRE(plan.world_size >= 1 && plan.shard_elems >= 1 && plan.dtype_bytes >= 1 &&
                   plan.alignment_bytes >= 1,
               "FSDP plan '", g, "' needs world_size, shard_elems, dtype_bytes and alignment_bytes "
               ">= 1, got ", plan.world_size, ", ", plan.shard_elems, ", ", plan.dtype_bytes, ", ",
               plan.alignment_bytes);
  LOOM_REQUIRE(!plan.tensors.empty(), "FSDP plan '", g, "' has no tensors");
  int64_t buffer = 0;
  int64_t shard_bytes = 0;
  LOOM_REQUIRE(!__builtin_mul_overflow(plan.world_size, plan.shard_elems, &buffer) &&
                   !__builtin_mul_overflow(plan.shard_elems, plan.dtype_bytes, &shard_bytes),
               "FSDP plan '", g, "': buffer size exceeds int64");
  LOOM_REQUIRE(shard_bytes % plan.alignment_bytes == 0, "FSDP plan '", g, "': shard of ",
               shard_bytes, " bytes is not a multiple of the ", plan.alignment_bytes,
               "-byte alignment");
  // Every piece as a global [begin, end) interval; sorted, neighbours must not overlap.
  std::vector<std::pair<FlatRange, size_t>> pieces;
  std::unordered_set<std::string> names;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const TensorLayout& t = plan.tensors[i];
    LOOM_REQUIRE(names.insert(t.name).second, "FSDP plan '", g, "' lists tensor '", t.name,
                 "' twice");
    const int64_t numel = tensor::checked_numel(t.name, t.shape);
    LOOM_REQUIRE(numel == t.numel, "FSDP plan '", g, "': tensor '", t.name, "' records ", t.numel,
                 " elements but its shape ", tensor::shape_str(t.shape), " has ", numel);
    const int64_t granule = tensor::granule_elems(t.granularity, t.name, t.shape);
    LOOM_REQUIRE(t.shard.granule_elems == granule, "FSDP plan '", g, "': tensor '", t.name,
                 "' has granule ", t.shard.granule_elems, " but ", t.granularity.str(),
                 " granularity of shape ", tensor::shape_str(t.shape), " means ", granule);
    LOOM_REQUIRE(t.shard.world_size() == plan.world_size, "FSDP plan '", g, "': tensor '", t.name,
                 "' is split over ", t.shard.world_size(), " ranks, the group over ",
                 plan.world_size);
    t.shard.validate(t.name, numel);
    LOOM_REQUIRE(t.offset >= 0 && t.offset <= buffer, "FSDP plan '", g, "': tensor '", t.name,
                 "' starts at ", t.offset, ", outside the buffer of ", buffer, " elements");
    bool first = true;
    for_each_piece(t, plan.shard_elems, [&](int64_t r, int64_t begin, int64_t len) {
      LOOM_REQUIRE(begin >= 0 && begin + len <= plan.shard_elems, "FSDP plan '", g, "': tensor '",
                   t.name, "' puts ", len, " elements at local offset ", begin, " of rank ", r,
                   ", whose shard holds ", plan.shard_elems, " (a granule straddles the boundary)");
      if (first) {
        LOOM_REQUIRE(r * plan.shard_elems + begin == t.offset, "FSDP plan '", g, "': tensor '",
                     t.name, "' offset ", t.offset, " is not on its first rank ", r);
        first = false;
      }
      pieces.push_back({{r * plan.shard_elems + begin, r * plan.shard_elems + begin + len}, i});
    });
  }
  std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) {
    return a.first.begin < b.first.begin;
  });
  for (size_t k = 1; k < pieces.size(); ++k) {
    LOOM_REQUIRE(pieces[k - 1].first.end <= pieces[k].first.begin, "FSDP plan '", g,
                 "': tensors '", plan.tensors[pieces[k - 1].second].name, "' and '",
                 plan.tensors[pieces[k].second].name, "' overlap at flat index ",
                 pieces[k].first.begin);
  }
}

nlohmann::json plan_to_json(const Plan& plan) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorLayout& t : plan.tensors) {
    tensors.push_back({{"name", t.name},
                       {"shape", t.shape},
                       {"granularity", t.granularity},
                       {"numel", t.numel},
                       {"offset", t.offset},
                       {"shard", t.shard}});
  }
  return {{"format", kPlanFormat},
          {"group", plan.group},
          {"world_size", plan.world_size},
          {"shard_elems", plan.shard_elems},
          {"dtype_bytes", plan.dtype_bytes},
          {"alignment_bytes", plan.alignment_bytes},
          {"order", to_string(plan.order)},
          {"tensors", std::move(tensors)},
          {"summary",
           {{"buffer_elems", plan.buffer_elems()},
            {"total_numel", plan.total_numel()},
            {"padding_elems", plan.padding_elems()},
            {"padding_fraction", plan.padding_fraction()},
            {"shard0_padding_elems", plan.shard0_padding_elems()},
            {"shard0_padding_fraction", plan.shard0_padding_fraction()}}}};
}

Plan plan_from_json(const nlohmann::json& j) {
  Plan plan;
  try {
    const auto format = field(j, "format").get<std::string>();
    LOOM_REQUIRE(format == kPlanFormat, "FSDP plan JSON has format '", format, "', expected '",
                 kPlanFormat, "'; fix: regenerate the plan with this version of loom");
    plan.group = field(j, "group").get<std::string>();
    plan.world_size = field(j, "world_size").get<int64_t>();
    plan.shard_elems = field(j, "shard_elems").get<int64_t>();
    plan.dtype_bytes = field(j, "dtype_bytes").get<int64_t>();
    plan.alignment_bytes = field(j, "alignment_bytes").get<int64_t>();
    plan.order = tensor_order_from_string(field(j, "order").get<std::string>());
    const nlohmann::json& tensors = field(j, "tensors");
    LOOM_REQUIRE(tensors.is_array(), "FSDP plan JSON field 'tensors' must be an array");
    for (const nlohmann::json& t : tensors) {
      TensorLayout layout;
      layout.name = field(t, "name").get<std::string>();
      layout.shape = field(t, "shape").get<std::vector<int64_t>>();
      layout.granularity = field(t, "granularity").get<Granularity>();
      layout.numel = field(t, "numel").get<int64_t>();
      layout.offset = field(t, "offset").get<int64_t>();
      layout.shard = field(t, "shard").get<tensor::RaggedShard>();
      plan.tensors.push_back(std::move(layout));
    }
  } catch (const nlohmann::json::exception& e) {
    fail("FSDP plan JSON is malformed: ", e.what());
  }
  validate_plan(plan);
  return plan;
}

}  // namespace loom::fsdp
