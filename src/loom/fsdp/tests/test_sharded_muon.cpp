// Muon's FSDP placement (fsdp::muon_granularity): on the debug model's groups every Muon matrix
// lies whole on one rank, and the planner's shard size is the best any whole-matrix placement can
// reach (checked against a brute force over every assignment of matrices to ranks). Prints the
// padding figures quoted in docs/muon.md. The optimizer itself runs multi-rank through the Trainer
// (src/loom/train/tests/test_trainer_muon.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "loom/fsdp/planner.h"
#include "loom/fsdp/sharded_muon.h"

namespace {
using loom::fsdp::GroupSpec;
using loom::fsdp::Plan;
using loom::fsdp::TensorSpec;

// The debug flavor's FSDP groups as llama3's parallelize wraps them (names relative to the
// group's module, as the planner sees them): one per block, then the root.
std::vector<GroupSpec> debug_model_groups() {
  const int64_t dim = 256, ffn = 768, vocab = 2048;
  const auto granularity = loom::fsdp::muon_granularity();
  auto spec = [&](std::string name, std::vector<int64_t> shape) {
    TensorSpec t{name, shape, 4, granularity(name, shape)};
    return t;
  };
  GroupSpec block{"layers.0",
                  {spec("attention_norm.weight", {dim}), spec("attention.wq.weight", {dim, dim}),
                   spec("attention.wk.weight", {dim, dim}), spec("attention.wv.weight", {dim, dim}),
                   spec("attention.wo.weight", {dim, dim}), spec("ffn_norm.weight", {dim}),
                   spec("feed_forward.w1.weight", {ffn, dim}), spec("feed_forward.w2.weight", {dim, ffn}),
                   spec("feed_forward.w3.weight", {ffn, dim})}};
  GroupSpec root{"root", {spec("tok_embeddings.weight", {vocab, dim}), spec("norm.weight", {dim}),
                          spec("output.weight", {vocab, dim})}};
  return {block, root};
}

// The smallest 4-aligned shard size any placement with every whole tensor on one rank reaches:
// brute force over the assignments of the whole tensors to ranks; element tensors fill any gap.
int64_t best_whole_placement(const GroupSpec& g, int64_t world) {
  std::vector<int64_t> whole;
  int64_t total = 0;
  for (const auto& t : g.tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    total += n;
    if (t.granularity.kind == loom::tensor::Granularity::Kind::kWhole) whole.push_back(n);
  }
  int64_t best_max = total;
  std::vector<int64_t> load(world, 0);
  std::function<void(size_t)> assign = [&](size_t i) {
    if (i == whole.size()) {
      best_max = std::min(best_max, *std::max_element(load.begin(), load.end()));
      return;
    }
    for (int64_t r = 0; r < world; ++r) {
      load[r] += whole[i];
      assign(i + 1);
      load[r] -= whole[i];
    }
  };
  assign(0);
  const int64_t s = std::max(best_max, (total + world - 1) / world);
  return (s + 3) / 4 * 4;
}

}  // namespace

TEST(ShardedMuonPlacement, DebugModelMatricesAreWholeAndThePlanIsTheBestWholePlacement) {
  for (int64_t world : {1, 2, 4}) {
    int64_t buffer = 0, numel = 0;
    for (const GroupSpec& g : debug_model_groups()) {
      const Plan plan = loom::fsdp::plan_group(g, world);
      for (size_t i = 0; i < plan.tensors.size(); ++i) {
        const auto& t = plan.tensors[i];
        if (t.granularity.kind != loom::tensor::Granularity::Kind::kWhole) continue;
        int owners = 0;
        for (int64_t r = 0; r < world; ++r) {
          const int64_t held = plan.local_range(i, r).size();
          owners += held > 0;
          EXPECT_TRUE(held == 0 || held == t.numel) << t.name << " cut at W=" << world;
        }
        EXPECT_EQ(owners, 1) << g.name << " " << t.name << " at W=" << world;
      }
      EXPECT_EQ(plan.shard_elems, best_whole_placement(g, world)) << g.name << " at W=" << world;
      const int64_t copies = g.name == "root" ? 1 : 6;  // the debug model has 6 blocks
      buffer += copies * plan.buffer_elems();
      numel += copies * plan.total_numel();
      std::printf("W=%lld group %-8s S=%7lld padding %6.2f %%\n", static_cast<long long>(world), g.name.c_str(),
                  static_cast<long long>(plan.shard_elems), 100.0 * plan.padding_fraction());
    }
    std::printf("W=%lld whole model (6 blocks + root): %lld parameters in %lld buffer elements, padding %.2f %%\n",
                static_cast<long long>(world), static_cast<long long>(numel), static_cast<long long>(buffer),
                100.0 * static_cast<double>(buffer - numel) / static_cast<double>(buffer));
  }
}

TEST(ShardedMuonPlacement, GranularityFollowsTheSplitRule) {
  const auto g = loom::fsdp::muon_granularity();
  using Kind = loom::tensor::Granularity::Kind;
  EXPECT_EQ(g("attention.wq.weight", {256, 256}).kind, Kind::kWhole);
  EXPECT_EQ(g("tok_embeddings.weight", {2048, 256}).kind, Kind::kElement);
  EXPECT_EQ(g("output.weight", {2048, 256}).kind, Kind::kElement);
  EXPECT_EQ(g("norm.weight", {256}).kind, Kind::kElement);
}
