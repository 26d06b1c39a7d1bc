#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "loom/testing/errors.h"
#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/fsdp/planner.h"

namespace {

using loom::fsdp::GroupSpec;
using loom::fsdp::Plan;
using loom::fsdp::PlannerOptions;
using loom::fsdp::TensorOrder;
using loom::fsdp::TensorSpec;
using loom::tensor::Granularity;

using loom::testing::expect_error;

int64_t numel_of(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

// Granule size computed here from first principles, independent of the library.
int64_t expected_granule(const TensorSpec& t) {
  const int64_t n = numel_of(t.shape);
  if (n == 0) return 1;
  const int64_t row = t.shape.size() <= 1 ? 1 : n / t.shape[0];
  switch (t.granularity.kind) {
    case Granularity::Kind::kElement: return 1;
    case Granularity::Kind::kRow: return row;
    case Granularity::Kind::kRowBlock: return t.granularity.rows_per_block * row;
    case Granularity::Kind::kWhole: return n;
    case Granularity::Kind::kElementBlock: return t.granularity.elems_per_block;
  }
  return -1;
}

// Walks every granule of every tensor: each lies inside one rank's [r·S, (r+1)·S), tensors never
// overlap, each tensor's units cover it, S is 16-byte aligned, tensors stay in module order.
void check_plan(const GroupSpec& group, const Plan& plan, int64_t world) {
  ASSERT_EQ(plan.world_size, world);
  ASSERT_EQ(plan.tensors.size(), group.tensors.size());
  const int64_t s = plan.shard_elems;
  ASSERT_GT(s, 0);
  EXPECT_EQ(s * plan.dtype_bytes % plan.alignment_bytes, 0)
      << "S=" << s << " dtype=" << plan.dtype_bytes << " alignment=" << plan.alignment_bytes;
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (size_t i = 0; i < group.tensors.size(); ++i) {
    const TensorSpec& spec = group.tensors[i];
    const auto& t = plan.tensors[i];
    ASSERT_EQ(t.name, spec.name);
    const int64_t g = expected_granule(spec);
    ASSERT_EQ(t.shard.granule_elems, g) << t.name;
    ASSERT_EQ(t.shard.world_size(), world);
    ASSERT_EQ(t.shard.total_units() * g, numel_of(spec.shape)) << t.name;
    bool first = true;
    for (int64_t r = 0; r < world; ++r) {
      const int64_t units = t.shard.units_per_rank[r];
      if (units == 0) continue;
      int64_t pos = first ? t.offset : r * s;
      ASSERT_EQ(plan.local_range(i, r).begin, pos - r * s);
      ASSERT_EQ(plan.local_range(i, r).size(), units * g);
      first = false;
      for (int64_t k = 0; k < units; ++k, pos += g) {
        ASSERT_EQ(pos / s, r) << t.name << " granule starts outside rank " << r;
        ASSERT_EQ((pos + g - 1) / s, r) << t.name << " granule straddles rank " << r << "'s end";
      }
      pieces.emplace_back(pos - units * g, pos);
    }
  }
  std::sort(pieces.begin(), pieces.end());
  for (size_t k = 1; k < pieces.size(); ++k) {
    ASSERT_LE(pieces[k - 1].second, pieces[k].first) << "two tensors overlap";
  }
  if (!pieces.empty()) {
    ASSERT_LE(pieces.back().second, world * s);
  }
  EXPECT_NO_THROW(loom::fsdp::validate_plan(plan));
}

// The three orders the planner tries, rebuilt here from their definitions.
std::vector<std::vector<size_t>> candidate_orders(const GroupSpec& group) {
  const size_t n = group.tensors.size();
  std::vector<size_t> module(n);
  std::iota(module.begin(), module.end(), size_t{0});
  auto desc = module;
  std::stable_sort(desc.begin(), desc.end(), [&](size_t a, size_t b) {
    return expected_granule(group.tensors[a]) > expected_granule(group.tensors[b]);
  });
  auto cls = module;
  auto rank_of = [&](size_t i) {
    switch (group.tensors[i].granularity.kind) {
      case Granularity::Kind::kWhole: return 0;
      case Granularity::Kind::kRowBlock:
      case Granularity::Kind::kElementBlock: return 1;
      case Granularity::Kind::kRow: return 2;
      case Granularity::Kind::kElement: return 3;
    }
    return 4;
  };
  std::stable_sort(cls.begin(), cls.end(),
                   [&](size_t a, size_t b) { return rank_of(a) < rank_of(b); });
  return {module, desc, cls};
}

// Brute force: the smallest aligned S for which the granule sequence (in `order`) splits into at
// most W consecutive runs of at most S elements each, by dynamic programming over prefixes for
// every S from the alignment upward.
int64_t brute_force_min_shard(const GroupSpec& group, const std::vector<size_t>& order,
                              int64_t world, int64_t align) {
  std::vector<int64_t> granules;
  for (size_t i : order) {
    const int64_t g = expected_granule(group.tensors[i]);
    for (int64_t k = 0; k < numel_of(group.tensors[i].shape) / g; ++k) granules.push_back(g);
  }
  const size_t n = granules.size();
  for (int64_t s = align;; s += align) {
    std::vector<int64_t> runs(n + 1, INT64_MAX);  // runs[i]: fewest runs covering granules [0, i)
    runs[0] = 0;
    for (size_t i = 1; i <= n; ++i) {
      int64_t sum = 0;
      for (size_t j = i; j-- > 0;) {
        sum += granules[j];
        if (sum > s) break;
        if (runs[j] != INT64_MAX) runs[i] = std::min(runs[i], runs[j] + 1);
      }
    }
    if (runs[n] <= world) return s;
  }
}

TensorSpec random_tensor(std::mt19937_64& rng, const std::string& name, int64_t dtype_bytes,
                         int64_t max_rows, int64_t max_cols) {
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  std::vector<int64_t> shape;
  switch (uni(0, 3)) {
    case 0: shape = {uni(1, max_rows * 3)}; break;
    case 1: shape = {uni(1, max_rows), uni(1, 3), uni(1, 3)}; break;
    default: shape = {uni(1, max_rows), uni(1, max_cols)}; break;
  }
  Granularity g;
  switch (uni(0, 3)) {
    case 0: g = Granularity::element(); break;
    case 1: g = Granularity::row(); break;
    case 2: {  // a block height that divides dim 0
      std::vector<int64_t> divisors;
      for (int64_t k = 1; k <= shape[0]; ++k) {
        if (shape[0] % k == 0) divisors.push_back(k);
      }
      g = Granularity::row_block(divisors[uni(0, static_cast<int64_t>(divisors.size()) - 1)]);
      break;
    }
    default: g = Granularity::whole(); break;
  }
  return {name, shape, dtype_bytes, g};
}

GroupSpec random_group(std::mt19937_64& rng, int64_t max_tensors, int64_t max_rows,
                       int64_t max_cols) {
  const int64_t dtypes[] = {1, 2, 4, 8};
  const int64_t dtype = dtypes[std::uniform_int_distribution<int>(0, 3)(rng)];
  GroupSpec group{"g", {}};
  const int64_t n = std::uniform_int_distribution<int64_t>(1, max_tensors)(rng);
  for (int64_t i = 0; i < n; ++i) {
    group.tensors.push_back(random_tensor(rng, "t" + std::to_string(i), dtype, max_rows, max_cols));
  }
  return group;
}

TEST(Planner, NoGranuleStraddlesOnRandomGroups) {
  std::mt19937_64 rng(7);
  for (int64_t world : {1, 2, 3, 7, 8, 64}) {
    for (int trial = 0; trial < 60; ++trial) {
      const GroupSpec group = random_group(rng, 8, 70, 40);
      const Plan plan = loom::fsdp::plan_group(group, world);
      SCOPED_TRACE(loom::fsdp::plan_to_json(plan).dump());
      EXPECT_EQ(plan.alignment_bytes, 16);  // NCCL-friendly default
      check_plan(group, plan, world);
      if (HasFatalFailure()) return;
      // S never drops below the lower bound: all elements, and the largest granule, must fit.
      int64_t total = 0, max_granule = 1;
      for (const auto& t : group.tensors) {
        total += numel_of(t.shape);
        max_granule = std::max(max_granule, expected_granule(t));
      }
      EXPECT_GE(plan.shard_elems * world, total);
      EXPECT_GE(plan.shard_elems, max_granule);
    }
  }
}

TEST(Planner, ShardSizeIsMinimalAgainstBruteForce) {
  std::mt19937_64 rng(11);
  int strictly_better_reorders = 0;
  for (int64_t world : {1, 2, 3, 7, 8}) {
    for (int trial = 0; trial < 60; ++trial) {
      const GroupSpec group = random_group(rng, 5, 8, 5);
      const int64_t align = 16 / std::gcd<int64_t>(16, group.tensors[0].dtype_bytes);
      const Plan plan = loom::fsdp::plan_group(group, world);
      SCOPED_TRACE(loom::fsdp::plan_to_json(plan).dump());
      const auto orders = candidate_orders(group);
      std::vector<int64_t> brute;
      for (const auto& order : orders) brute.push_back(brute_force_min_shard(group, order, world, align));
      const int64_t best = *std::min_element(brute.begin(), brute.end());
      ASSERT_EQ(plan.shard_elems, best);
      // Ties go to the first order in the list (module order first).
      const size_t first_best = std::find(brute.begin(), brute.end(), best) - brute.begin();
      EXPECT_EQ(static_cast<size_t>(plan.order), first_best);
      strictly_better_reorders += best < brute[0];
      // Module order alone reaches exactly its own brute-force minimum.
      PlannerOptions module_only;
      module_only.try_reorder = false;
      EXPECT_EQ(loom::fsdp::plan_group(group, world, module_only).shard_elems, brute[0]);
    }
  }
  EXPECT_GT(strictly_better_reorders, 0) << "no random case exercised a winning reorder";
}

TEST(Planner, ReorderWinsOnlyWhenStrictlySmaller) {
  // Module order: [2] [5 5 5] [1 1] over W = 2 needs S = 12; largest granule first needs 10.
  GroupSpec group{"g",
                  {{"a", {1, 2}, 4, Granularity::row()},
                   {"b", {3, 5}, 4, Granularity::row()},
                   {"c", {2}, 4, Granularity::element()}}};
  PlannerOptions options;
  options.alignment_bytes = 4;  // one fp32 element: isolates the ordering effect
  const Plan plan = loom::fsdp::plan_group(group, 2, options);
  EXPECT_EQ(plan.shard_elems, 10);
  EXPECT_EQ(plan.order, TensorOrder::kGranuleDescending);
  EXPECT_EQ(plan.buffer_order(), (std::vector<size_t>{1, 0, 2}));
  check_plan(group, plan, 2);
  options.try_reorder = false;
  const Plan module = loom::fsdp::plan_group(group, 2, options);
  EXPECT_EQ(module.shard_elems, 12);
  EXPECT_EQ(module.order, TensorOrder::kModule);

  // Every order reaches the lower bound here: the tie keeps module order (norm before matrix),
  // although the class order (matrix first) differs.
  GroupSpec tie{"tie", {{"norm", {8}, 4, Granularity::element()},
                        {"w", {8, 4}, 4, Granularity::row()}}};
  const Plan tied = loom::fsdp::plan_group(tie, 2);
  EXPECT_EQ(tied.shard_elems, 20);
  EXPECT_EQ(tied.order, TensorOrder::kModule);
  EXPECT_EQ(tied.tensors[0].offset, 0);
  EXPECT_EQ(tied.tensors[1].offset, 8);
}

TEST(Planner, PaddingAndLayoutByHand) {
  // W = 4, fp32 (S a multiple of 4): 33 elements → S ≥ ceil(33/4) = 9 → 12. Rows of 5 fit two per
  // rank (2 elements of padding each); the 3-element vector fills rank 2's tail and spills to 3.
  GroupSpec group{"g", {{"w", {6, 5}, 4, Granularity::row()},
                        {"b", {3}, 4, Granularity::element()}}};
  const Plan plan = loom::fsdp::plan_group(group, 4);
  check_plan(group, plan, 4);
  EXPECT_EQ(plan.shard_elems, 12);
  EXPECT_EQ(plan.shard_bytes(), 48);
  EXPECT_EQ(plan.buffer_elems(), 48);
  EXPECT_EQ(plan.total_numel(), 33);
  EXPECT_EQ(plan.padding_elems(), 15);
  EXPECT_DOUBLE_EQ(plan.padding_fraction(), 15.0 / 48.0);
  // FSDP2: w → ceil(6/4)·4 = 8 rows of 5, b → 4 elements: 44 allocated, 11 padding.
  EXPECT_EQ(plan.shard0_buffer_elems(), 44);
  EXPECT_EQ(plan.shard0_padding_elems(), 11);
  EXPECT_DOUBLE_EQ(plan.shard0_padding_fraction(), 11.0 / 44.0);
  EXPECT_EQ(plan.tensors[0].offset, 0);
  EXPECT_EQ(plan.tensors[0].shard.units_per_rank, (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(plan.tensors[1].offset, 34);
  EXPECT_EQ(plan.tensors[1].shard.units_per_rank, (std::vector<int64_t>{0, 0, 2, 1}));
  EXPECT_EQ(plan.local_range(1, 2), (loom::tensor::FlatRange{10, 12}));
  EXPECT_EQ(plan.local_range(1, 3), (loom::tensor::FlatRange{0, 1}));
  EXPECT_TRUE(plan.local_range(1, 0).empty());
  EXPECT_FALSE(plan.contiguous(0));  // padding after every two rows
  EXPECT_TRUE(plan.contiguous(1));   // rank 2's tail runs straight into rank 3's head
  // The per-rank RaggedShard of w gives each rank whole rows.
  EXPECT_EQ(plan.tensors[0].shard.local_shape(1, {6, 5}), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(loom::fsdp::shard0_padded_numel({6, 5}, 4), 40);
  EXPECT_EQ(loom::fsdp::shard0_padded_numel({}, 4), 4);
}

TEST(Planner, AlignmentFollowsDtype) {
  // One element over 4 ranks: S is the smallest 16-byte shard for each dtype.
  for (auto [bytes, elems] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {2, 8}, {4, 4}, {8, 2}, {3, 16}}) {
    GroupSpec group{"g", {{"x", {1}, bytes, Granularity::element()}}};
    EXPECT_EQ(loom::fsdp::plan_group(group, 4).shard_elems, elems) << bytes << "-byte dtype";
  }
  GroupSpec group{"g", {{"x", {1}, 4, Granularity::element()}}};
  PlannerOptions options;
  options.alignment_bytes = 128;
  EXPECT_EQ(loom::fsdp::plan_group(group, 4, options).shard_elems, 32);
}

TEST(Planner, WholeTensorsStayOnOneRank) {
  GroupSpec group{"g", {{"a", {7, 3}, 4, Granularity::whole()},
                        {"b", {5}, 4, Granularity::whole()},
                        {"c", {9, 2}, 4, Granularity::whole()}}};
  const Plan plan = loom::fsdp::plan_group(group, 3);
  check_plan(group, plan, 3);
  for (const auto& t : plan.tensors) {
    EXPECT_EQ(std::count_if(t.shard.units_per_rank.begin(), t.shard.units_per_rank.end(),
                            [](int64_t u) { return u > 0; }),
              1)
        << t.name;
  }
}

// AdamW8bit's quantization blocks (element-block granularity): on any number of ranks every rank
// holds whole 256-element blocks of each blocked tensor, counted from the tensor's first element.
TEST(Planner, ElementBlocksStayWholeOnEveryRank) {
  const Granularity block = Granularity::element_block(256);
  EXPECT_EQ(block.str(), "256-element");
  EXPECT_EQ(Granularity::parse("256-element"), block);
  GroupSpec group{"layers.0", {{"attention_norm", {64}, 4, Granularity::element()},
                               {"wq", {64, 64}, 4, block},
                               {"wk", {32, 64}, 4, block},
                               {"ffn_norm", {64}, 4, Granularity::element()},
                               {"w1", {192, 64}, 4, block}}};
  for (int64_t world : {1, 2, 3, 4, 7, 16}) {
    const Plan plan = loom::fsdp::plan_group(group, world);
    check_plan(group, plan, world);
    int64_t cut = 0;
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
      if (group.tensors[i].granularity != block) continue;
      int64_t held = 0;  // elements of the tensor on ranks before r
      for (int64_t r = 0; r < world; ++r) {
        const auto range = plan.local_range(i, r);
        EXPECT_EQ(range.size() % 256, 0) << plan.tensors[i].name << " on rank " << r;
        EXPECT_EQ(held % 256, 0) << plan.tensors[i].name << " on rank " << r;
        held += range.size();
        cut += !range.empty() && range.size() < plan.tensors[i].numel;
      }
    }
    if (world > 2) EXPECT_GT(cut, 0) << "no blocked tensor was split over " << world << " ranks";
    EXPECT_EQ(loom::fsdp::plan_from_json(loom::fsdp::plan_to_json(plan)), plan);
  }
  expect_error([&] { loom::fsdp::plan_group({"g", {{"b", {100}, 4, block}}}, 2); },
               {"'b'", "256-element blocks do not divide it"});
}

TEST(Planner, Deterministic) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    const GroupSpec group = random_group(rng, 8, 50, 30);
    const Plan a = loom::fsdp::plan_group(group, 7);
    const Plan b = loom::fsdp::plan_group(group, 7);
    EXPECT_EQ(a, b);
    EXPECT_EQ(loom::fsdp::plan_to_json(a).dump(), loom::fsdp::plan_to_json(b).dump());
  }
}

TEST(Planner, JsonRoundTrip) {
  std::mt19937_64 rng(5);
  for (int64_t world : {1, 3, 64}) {
    const GroupSpec group = random_group(rng, 8, 50, 30);
    const Plan plan = loom::fsdp::plan_group(group, world);
    const std::string text = loom::fsdp::plan_to_json(plan).dump(2);
    const Plan back = loom::fsdp::plan_from_json(nlohmann::json::parse(text));
    EXPECT_EQ(back, plan);
    const auto j = nlohmann::json::parse(text);
    EXPECT_EQ(j.at("format"), "loom.fsdp.plan/1");
    EXPECT_EQ(j.at("summary").at("padding_elems").get<int64_t>(), plan.padding_elems());
  }
}

TEST(Planner, LoadedPlanIsValidated) {
  GroupSpec group{"g", {{"w", {6, 5}, 4, Granularity::row()},
                        {"b", {3}, 4, Granularity::element()}}};
  const nlohmann::json good = loom::fsdp::plan_to_json(loom::fsdp::plan_group(group, 4));

  nlohmann::json bad = good;
  bad["tensors"][1]["offset"] = 8;  // b's first rank is now rank 0, where w already sits
  bad["tensors"][1]["shard"]["first_rank"] = 0;
  bad["tensors"][1]["shard"]["units"] = {3};
  expect_error([&] { loom::fsdp::plan_from_json(bad); }, {"'w'", "'b'", "overlap"});

  bad = good;
  bad["tensors"][0]["shard"]["units"] = {3, 1, 2};  // 3 rows = 15 elements > S = 12
  expect_error([&] { loom::fsdp::plan_from_json(bad); }, {"'w'", "straddles"});

  bad = good;
  bad["tensors"][0]["granularity"] = "element";  // granule 1 but shard says 5
  expect_error([&] { loom::fsdp::plan_from_json(bad); }, {"'w'", "granule 5"});

  bad = good;
  bad["shard_elems"] = 13;  // 52 bytes
  expect_error([&] { loom::fsdp::plan_from_json(bad); }, {"52 bytes", "16-byte"});

  bad = good;
  bad["format"] = "something/2";
  expect_error([&] { loom::fsdp::plan_from_json(bad); }, {"something/2", "loom.fsdp.plan/1"});

  bad = good;
  bad.erase("world_size");
  expect_error([&] { loom::fsdp::plan_from_json(bad); }, {"world_size"});

  bad = good;
  bad["dtype_bytes"] = "four";
  expect_error([&] { loom::fsdp::plan_from_json(bad); }, {"malformed"});
}

TEST(Planner, BadInputIsOneLineError) {
  expect_error(
      [] {
        loom::fsdp::plan_group({"layers.0", {{"wk", {40, 8}, 4, Granularity::row_block(32)}}}, 8);
      },
      {"'wk'", "[40, 8]", "32-row", "40 rows"});
  for (int64_t world : {0, -3}) {
    expect_error([&] { loom::fsdp::plan_group({"g", {{"x", {4}, 4, {}}}}, world); },
                 {"'g'", "shard-group size", std::to_string(world)});
  }
  EXPECT_THROW(loom::fsdp::plan_group({"g", {{"x", {4}, 4, {}}}}, 0), loom::UsageError);
  expect_error([] { loom::fsdp::plan_group({"empty", {}}, 8); }, {"'empty'", "no tensors"});
  expect_error(
      [] { loom::fsdp::plan_group({"g", {{"a", {4}, 4, {}}, {"b", {4}, 2, {}}}}, 8); },
      {"'g'", "4-byte", "2-byte", "'b'"});
  expect_error([] { loom::fsdp::plan_group({"g", {{"a", {4}, 4, {}}, {"a", {4}, 4, {}}}}, 8); },
               {"'a'", "twice"});
  expect_error([] { loom::fsdp::plan_group({"g", {{"a", {4}, 0, {}}}}, 8); }, {"'a'", "dtype"});
  // A 2^40-element whole tensor needs S ≥ 2^40; over 2^30 ranks the buffer passes 2^63.
  expect_error(
      [] {
        loom::fsdp::plan_group({"g", {{"huge", {int64_t{1} << 40}, 1, Granularity::whole()}}},
                               int64_t{1} << 30);
      },
      {"'g'", "exceeds int64"});
}

TEST(Planner, EmptyTensorsTakeNoSpace) {
  GroupSpec group{"g", {{"a", {0, 4}, 4, Granularity::row()},
                        {"b", {10}, 4, Granularity::element()},
                        {"c", {3, 0}, 4, Granularity::whole()}}};
  const Plan plan = loom::fsdp::plan_group(group, 2);
  check_plan(group, plan, 2);
  EXPECT_EQ(plan.shard_elems, 8);
  EXPECT_EQ(plan.tensors[0].shard.total_units(), 0);
}

// Llama 3 405B as TorchTitan wraps it: one group per block plus the root group, fp32.
std::vector<GroupSpec> llama3_405b(Granularity matrix) {
  const int64_t dim = 16384, ffn = 53248, q = 128 * 128, kv = 8 * 128, vocab = 128256;
  auto t = [&](std::string name, std::vector<int64_t> shape) {
    const Granularity g = shape.size() >= 2 ? matrix : Granularity::element();
    return TensorSpec{std::move(name), std::move(shape), 4, g};
  };
  std::vector<GroupSpec> groups;
  for (int i = 0; i < 126; ++i) {
    groups.push_back({"layers." + std::to_string(i),
                      {t("attention_norm", {dim}), t("wq", {q, dim}), t("wk", {kv, dim}),
                       t("wv", {kv, dim}), t("wo", {dim, q}), t("ffn_norm", {dim}),
                       t("w1", {ffn, dim}), t("w2", {dim, ffn}), t("w3", {ffn, dim})}});
  }
  groups.push_back({"root", {t("tok_embeddings", {vocab, dim}), t("norm", {dim}),
                             t("output", {vocab, dim})}});
  return groups;
}

TEST(Planner, Llama3_405bAt512RanksPlansQuickly) {
  for (const Granularity& g : {Granularity::row(), Granularity::row_block(32)}) {
    const auto groups = llama3_405b(g);
    loom::Timer timer;
    const auto plans = loom::fsdp::plan_groups(groups, 512);
    const double seconds = timer.seconds();
    // Functional bound only (timing targets live in bench/; loom_plan_report prints real numbers).
    EXPECT_LT(seconds, 5.0) << g.str();
    ASSERT_EQ(plans.size(), 127u);
    int64_t numel = 0;
    for (size_t i = 0; i < plans.size(); ++i) {
      EXPECT_EQ(plans[i].group, groups[i].name);
      EXPECT_NO_THROW(loom::fsdp::validate_plan(plans[i]));
      numel += plans[i].total_numel();
    }
    EXPECT_EQ(numel, 405'853'388'800);
    // Identical blocks get identical layouts.
    EXPECT_EQ(plans[0].shard_elems, plans[125].shard_elems);
    EXPECT_EQ(plans[0].tensors[3].shard, plans[125].tensors[3].shard);
  }
}

}  // namespace
