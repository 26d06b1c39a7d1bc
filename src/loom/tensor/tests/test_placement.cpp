// Placements and layouts (one process), and the autograd collectives on 2 and 4 ranks through
// `loom launch` (tests/worker/tensor_worker.cpp checks values and gradients on every rank).
#include <gtest/gtest.h>

#include "loom/core/error.h"
#include "loom/tensor/collectives.h"
#include "loom/tensor/placement.h"
#include "loom/testing/errors.h"
#include "loom/testing/run.h"
#include "loom/testing/worker.h"

namespace lt = loom::tensor;

TEST(Placement, LocalBoxNestsShardsInMeshOrder) {
  // A TP colwise weight [8, 6] (Shard(0) over tp=2) then FSDP-style Shard(0) over dp=2 of that.
  lt::TensorLayout layout;
  layout.global_shape = {8, 6};
  layout.placements = {{"dp_shard", lt::Shard{0}, /*rank=*/1, /*size=*/2},
                       {"tp", lt::Shard{1}, /*rank=*/1, /*size=*/2}};
  EXPECT_EQ(layout.local_box(), (lt::Box{{4, 3}, {4, 3}}));
  EXPECT_EQ(layout.local_shape(), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(layout.describe(), "[8, 6] dp_shard:Shard(0) tp:Shard(1)");
  // Two mesh dims sharding the same tensor dim: the second splits the first's piece.
  layout.placements = {{"dp_shard", lt::Shard{0}, 1, 2}, {"tp", lt::Shard{0}, 0, 2}};
  EXPECT_EQ(layout.local_box(), (lt::Box{{4, 0}, {2, 6}}));
  // Replicate and Partial do not cut the box.
  layout.placements = {{"dp_replicate", lt::Replicate{}, 1, 2}, {"tp", lt::Partial{}, 1, 2}};
  EXPECT_EQ(layout.local_box(), (lt::Box{{0, 0}, {8, 6}}));
  EXPECT_FALSE(layout.is_replicated());
  EXPECT_TRUE(lt::TensorLayout::replicated({3}).is_replicated());
  EXPECT_EQ(lt::to_string(lt::Partial{}), "Partial(sum)");
}

TEST(Placement, UnevenShardIsAUsageErrorNamingTheTensor) {
  lt::TensorLayout layout;
  layout.global_shape = {6, 5};
  layout.placements = {{"tp", lt::Shard{1}, 0, 2}};
  loom::testing::expect_error<loom::UsageError>(
      [&] { layout.local_box(); },
      {"dim 1 of size 5 does not split evenly over 2 ranks of mesh dim tp"});
}

// On one rank every collective is the identity and keeps the autograd graph intact.
TEST(Collectives, SingleRankIsTheIdentity) {
  auto comm = loom::distributed::Comm::single("tp", 0);
  torch::Tensor x = torch::randn({4, 3}, torch::requires_grad());
  torch::Tensor y = lt::all_gather(lt::reduce_scatter(lt::all_reduce(x, comm), 0, comm), 1, comm,
                                   lt::ReplicatedGrad::kPartial);
  EXPECT_TRUE(torch::equal(y, x));
  y.sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), torch::ones_like(x)));
}

namespace {
void expect_workers(int nproc) { loom::testing::expect_workers("loom_tensor_worker", "collectives", nproc, 120); }
}  // namespace

// Forward values and gradients of every collective, along dims 0, 2 and -2, against the
// single-process computation, on 2 and 4 ranks.
TEST(Collectives, ValuesAndGradientsOnTwoRanks) { expect_workers(2); }
TEST(Collectives, ValuesAndGradientsOnFourRanks) { expect_workers(4); }
