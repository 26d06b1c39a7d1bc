#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "loom/testing/errors.h"
#include "loom/core/error.h"
#include "loom/tensor/ragged_shard.h"

namespace {

using loom::tensor::FlatRange;
using loom::tensor::Granularity;
using loom::tensor::RaggedShard;

using loom::testing::expect_error;

// A random layout of `units` granules over `world` ranks (some ranks get none).
RaggedShard random_layout(std::mt19937_64& rng, int64_t units, int64_t world, int64_t granule) {
  RaggedShard s{std::vector<int64_t>(static_cast<size_t>(world), 0), granule};
  std::uniform_int_distribution<int64_t> pick(0, world - 1);
  // Cut points drawn uniformly; a third of the time, park everything on a few ranks.
  const bool lumpy = std::uniform_int_distribution<int>(0, 2)(rng) == 0;
  for (int64_t u = 0; u < units; ++u) s.units_per_rank[lumpy ? pick(rng) % 3 % world : pick(rng)]++;
  return s;
}

TEST(Granularity, GranuleSizes) {
  const std::vector<int64_t> m{64, 48};
  EXPECT_EQ(loom::tensor::granule_elems(Granularity::element(), "m", m), 1);
  EXPECT_EQ(loom::tensor::granule_elems(Granularity::row(), "m", m), 48);
  EXPECT_EQ(loom::tensor::granule_elems(Granularity::row_block(32), "m", m), 32 * 48);
  EXPECT_EQ(loom::tensor::granule_elems(Granularity::whole(), "m", m), 64 * 48);
  // 3-D: a row is everything after dim 0.
  EXPECT_EQ(loom::tensor::granule_elems(Granularity::row(), "c", {4, 3, 5}), 15);
  // 1-D and 0-D tensors: a row is one element.
  EXPECT_EQ(loom::tensor::granule_elems(Granularity::row(), "norm", {4096}), 1);
  EXPECT_EQ(loom::tensor::granule_elems(Granularity::row(), "scalar", {}), 1);
  EXPECT_EQ(loom::tensor::granule_elems(Granularity::whole(), "norm", {4096}), 4096);
  // An empty tensor has nothing to cut.
  EXPECT_EQ(loom::tensor::granule_elems(Granularity::whole(), "empty", {0, 7}), 1);
}

TEST(Granularity, BlockNotDividingTensorIsOneLineError) {
  expect_error([] { loom::tensor::granule_elems(Granularity::row_block(32), "wk", {1000, 64}); },
               {"'wk'", "[1000, 64]", "64000 elements", "32-row", "1000 rows"});
  expect_error([] { Granularity::row_block(0); }, {"at least 1 row"});
  expect_error([] { loom::tensor::checked_numel("bad", {3, -1}); }, {"'bad'", "negative"});
  expect_error([] { loom::tensor::checked_numel("huge", {1LL << 40, 1LL << 40}); },
               {"'huge'", "2^63"});
}

TEST(Granularity, TextRoundTrip) {
  for (const Granularity& g : {Granularity::element(), Granularity::row(),
                               Granularity::row_block(32), Granularity::whole()}) {
    EXPECT_EQ(Granularity::parse(g.str()), g) << g.str();
    nlohmann::json j = g;
    EXPECT_EQ(j.get<Granularity>(), g);
  }
  EXPECT_EQ(Granularity::row_block(16).str(), "16-row");
  for (const char* bad : {"rows", "0-row", "-row", "x-row", "32-rows", ""}) {
    EXPECT_THROW(Granularity::parse(bad), loom::UsageError) << bad;
  }
}

TEST(RaggedShard, RangesAndValidation) {
  const RaggedShard s{{2, 0, 3, 1}, 4};  // 6 granules of 4 elements
  EXPECT_EQ(s.world_size(), 4);
  EXPECT_EQ(s.numel(), 24);
  const std::vector<FlatRange> expected{{0, 8}, {8, 8}, {8, 20}, {20, 24}};
  EXPECT_EQ(s.rank_ranges(), expected);
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(s.rank_range(r), expected[r]);
  EXPECT_NO_THROW(s.validate("w", {6, 4}));
  EXPECT_NO_THROW(s.validate("w", {3, 8}));  // only the element count matters

  expect_error([&] { s.validate("w", {5, 4}); }, {"'w'", "covers 6 units x 4", "20 elements"});
  expect_error([&] { s.validate("w", {5, 5}); }, {"granule of 4", "'w'", "25 elements"});
  expect_error([] { RaggedShard{{}, 1}.validate("w", 0); }, {"no ranks"});
  expect_error([] { RaggedShard{{1}, 0}.validate("w", 0); }, {"granule"});
  expect_error([] { RaggedShard{{3, -1}, 1}.validate("w", 2); }, {"rank 1", "-1 units"});
  EXPECT_THROW(s.rank_range(4), loom::Error);
}

TEST(RaggedShard, Shard0EvenSplit) {
  // torch.chunk semantics: ceil(10 / 4) = 3 rows per rank, the last gets the remainder.
  const RaggedShard a = RaggedShard::shard0({10, 6}, 4);
  EXPECT_EQ(a.units_per_rank, (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(a.granule_elems, 6);
  // Fewer rows than ranks: the tail ranks hold nothing.
  EXPECT_EQ(RaggedShard::shard0({5}, 8).units_per_rank,
            (std::vector<int64_t>{1, 1, 1, 1, 1, 0, 0, 0}));
  // ceil(9 / 4) = 3 leaves rank 3 empty.
  EXPECT_EQ(RaggedShard::shard0({9, 2}, 4).units_per_rank, (std::vector<int64_t>{3, 3, 3, 0}));
  EXPECT_EQ(RaggedShard::shard0({}, 2).units_per_rank, (std::vector<int64_t>{1, 0}));
  EXPECT_TRUE(a.matches_shard0({10, 6}));
  // The same element ranges counted in other units are still Shard(0) ...
  EXPECT_TRUE((RaggedShard{{9, 9, 9, 3}, 2}.matches_shard0({10, 6})));
  EXPECT_TRUE((RaggedShard{{18, 18, 18, 6}, 1}.matches_shard0({10, 6})));
  // ... a ragged one is not.
  EXPECT_FALSE((RaggedShard{{4, 2, 3, 1}, 6}.matches_shard0({10, 6})));
  EXPECT_THROW(RaggedShard::shard0({4}, 0), loom::UsageError);
}

TEST(RaggedShard, LocalShape) {
  const std::vector<int64_t> shape{6, 4, 2};  // rows of 8 elements
  const RaggedShard rows{{2, 0, 4}, 8};
  EXPECT_EQ(rows.local_shape(0, shape), (std::vector<int64_t>{2, 4, 2}));
  EXPECT_EQ(rows.local_shape(1, shape), (std::vector<int64_t>{0, 4, 2}));
  EXPECT_EQ(rows.local_shape(2, shape), (std::vector<int64_t>{4, 4, 2}));
  // Element layout: whole rows only where the cut happens to land on row boundaries.
  const RaggedShard elems{{8, 20, 20}, 1};
  EXPECT_EQ(elems.local_shape(0, shape), (std::vector<int64_t>{1, 4, 2}));
  EXPECT_FALSE(elems.local_shape(1, shape).has_value());
  EXPECT_FALSE(elems.local_shape(2, shape).has_value());
  // 1-D: any range is whole rows.
  EXPECT_EQ((RaggedShard{{3, 2}, 1}.local_shape(1, {5})), (std::vector<int64_t>{2}));
  // No elements: torch.chunk's row split.
  const RaggedShard empty{{0, 0}, 1};
  EXPECT_EQ(empty.local_shape(0, {3, 0}), (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(empty.local_shape(1, {3, 0}), (std::vector<int64_t>{1, 0}));
}

// Executes a redistribute plan on plain vectors: rank r's source shard holds the global indices of
// its range; after the all-to-all every destination shard must hold exactly its own range.
void check_redistribution(const RaggedShard& from, const RaggedShard& to) {
  const loom::tensor::RedistributePlan plan = loom::tensor::plan_redistribute(from, to);
  const int64_t world = from.world_size();
  const auto src_ranges = from.rank_ranges();
  const auto dst_ranges = to.rank_ranges();
  std::vector<std::vector<int64_t>> src(world), dst(world);
  for (int64_t r = 0; r < world; ++r) {
    src[r].resize(src_ranges[r].size());
    std::iota(src[r].begin(), src[r].end(), src_ranges[r].begin);
    dst[r].assign(dst_ranges[r].size(), -1);
  }
  int64_t prev_begin = -1;
  for (const auto& c : plan.chunks) {
    ASSERT_GT(c.length, 0);
    ASSERT_GT(c.global_begin, prev_begin);
    prev_begin = c.global_begin;
    ASSERT_EQ(src_ranges[c.src_rank].begin + c.src_offset, c.global_begin);
    ASSERT_EQ(dst_ranges[c.dst_rank].begin + c.dst_offset, c.global_begin);
    for (int64_t k = 0; k < c.length; ++k) {
      ASSERT_EQ(dst[c.dst_rank][c.dst_offset + k], -1) << "element written twice";
      dst[c.dst_rank][c.dst_offset + k] = src[c.src_rank][c.src_offset + k];
    }
  }
  for (int64_t r = 0; r < world; ++r) {
    for (int64_t k = 0; k < dst_ranges[r].size(); ++k) {
      ASSERT_EQ(dst[r][k], dst_ranges[r].begin + k) << "rank " << r << " element " << k;
    }
  }
  // all_to_all_single contract: split sizes sum to the local shards, and sending the source shard
  // front to back with send_counts delivers the chunks in dst order (receive likewise).
  int64_t moved = 0;
  for (int64_t r = 0; r < world; ++r) {
    const auto send = plan.send_counts(r);
    const auto recv = plan.recv_counts(r);
    ASSERT_EQ(std::accumulate(send.begin(), send.end(), int64_t{0}), src_ranges[r].size());
    ASSERT_EQ(std::accumulate(recv.begin(), recv.end(), int64_t{0}), dst_ranges[r].size());
    int64_t src_cursor = 0;
    int64_t dst_cursor = 0;
    for (const auto& c : plan.chunks) {
      if (c.src_rank == r) {
        ASSERT_EQ(c.src_offset, src_cursor);
        src_cursor += c.length;
      }
      if (c.dst_rank == r) {
        ASSERT_EQ(c.dst_offset, dst_cursor);
        dst_cursor += c.length;
      }
    }
    for (int64_t q = 0; q < world; ++q) {
      if (q != r) moved += send[q];
    }
  }
  EXPECT_EQ(plan.elements_moved(), moved);
  EXPECT_LE(static_cast<int64_t>(plan.chunks.size()), 2 * world - 1);
}

TEST(RaggedShard, RedistributeMatchesSimulation) {
  std::mt19937_64 rng(1234);
  for (int64_t world : {1, 2, 3, 7, 8, 64}) {
    for (int trial = 0; trial < 25; ++trial) {
      // A tensor of rows × 12 elements: layouts in elements, rows, 3-row blocks and Shard(0).
      const int64_t rows = 3 * std::uniform_int_distribution<int64_t>(0, 40)(rng);
      const std::vector<int64_t> shape{rows, 12};
      const std::vector<RaggedShard> layouts{
          random_layout(rng, rows * 12, world, 1), random_layout(rng, rows, world, 12),
          random_layout(rng, rows / 3, world, 36), RaggedShard::shard0(shape, world)};
      for (const auto& from : layouts) {
        from.validate("t", shape);
        for (const auto& to : layouts) {
          SCOPED_TRACE(::testing::Message() << "W=" << world << " rows=" << rows);
          check_redistribution(from, to);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(RaggedShard, RedistributeIdentityMovesNothing) {
  const RaggedShard s{{3, 0, 2}, 5};
  const auto plan = loom::tensor::plan_redistribute(s, s);
  EXPECT_EQ(plan.elements_moved(), 0);
  EXPECT_EQ(plan.chunks.size(), 2u);
}

TEST(RaggedShard, RedistributeRejectsMismatchedLayouts) {
  expect_error([] { loom::tensor::plan_redistribute({{2, 2}, 1}, {{1, 1, 2}, 1}); },
               {"2 ranks", "3 ranks"});
  expect_error([] { loom::tensor::plan_redistribute({{2, 2}, 1}, {{2, 3}, 1}); },
               {"4 elements", "5 elements"});
}

TEST(RaggedShard, JsonRoundTripIsCompact) {
  RaggedShard s{std::vector<int64_t>(512, 0), 4096};
  s.units_per_rank[200] = 7;
  s.units_per_rank[201] = 0;
  s.units_per_rank[202] = 3;
  const nlohmann::json j = s;
  EXPECT_EQ(j.at("first_rank").get<int64_t>(), 200);
  EXPECT_EQ(j.at("units").size(), 3u);
  EXPECT_EQ(j.get<RaggedShard>(), s);
  const RaggedShard empty{{0, 0, 0}, 1};
  EXPECT_EQ(nlohmann::json(empty).get<RaggedShard>(), empty);

  nlohmann::json bad = j;
  bad["first_rank"] = 510;  // 3 counts from rank 510 run past rank 511
  expect_error([&] { bad.get<RaggedShard>(); }, {"rank 510", "512 ranks"});
  bad = j;
  bad["units"][0] = -2;
  expect_error([&] { bad.get<RaggedShard>(); }, {"-2", "non-negative"});
  bad = j;
  bad.erase("granule_elems");
  expect_error([&] { bad.get<RaggedShard>(); }, {"granule_elems"});
}

}  // namespace
