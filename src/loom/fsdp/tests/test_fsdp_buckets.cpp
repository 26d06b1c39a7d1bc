// Single-process tests of FSDP bucketing (issue 28): the bucket plan over the blocks' sizes,
// fully_shard of several modules as one group (apply_fsdp's buckets and its head group), whose
// parameter names stay the model's, training through the fused head + loss like the unwrapped
// model, and the prefetch depth (how many groups ahead the all-gathers are issued).
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/spec.h"
#include "loom/testing/tiny_llama.h"

namespace loom::fsdp::bucket_tests {

using Buckets = std::vector<std::pair<size_t, size_t>>;

TEST(FSDPBuckets, PlanMergesConsecutiveBlocksToAboutTheTarget) {
  // The 124M model's 28 MB blocks: a 50 MB target takes two (56 is nearer 50 than 28 is).
  EXPECT_EQ(plan_buckets({28, 28, 28, 28, 28}, 50), (Buckets{{0, 2}, {2, 4}, {4, 5}}));
  // A target at or under a block's size leaves every block alone, as does 0 (off).
  EXPECT_EQ(plan_buckets({28, 28, 28}, 25), (Buckets{{0, 1}, {1, 2}, {2, 3}}));
  EXPECT_EQ(plan_buckets({28, 28, 28}, 0), (Buckets{{0, 1}, {1, 2}, {2, 3}}));
  // Small blocks fill buckets of the target; the remainder is the last bucket.
  EXPECT_EQ(plan_buckets({1, 1, 1, 1, 1, 1, 1}, 3), (Buckets{{0, 3}, {3, 6}, {6, 7}}));
  // A block joins while the bucket ends nearer the target: 10 + 30 is 15 over 25 as 10 is 15
  // under (a tie joins: one collective fewer); 10 + 31 is further over, so 31 starts a bucket.
  EXPECT_EQ(plan_buckets({10, 30}, 25), (Buckets{{0, 2}}));
  EXPECT_EQ(plan_buckets({10, 31}, 25), (Buckets{{0, 1}, {1, 2}}));
  // A bucket already at the target closes, whatever follows.
  EXPECT_EQ(plan_buckets({100, 1, 1}, 25), (Buckets{{0, 1}, {1, 3}}));
  EXPECT_TRUE(plan_buckets({}, 25).empty());
  EXPECT_THROW(plan_buckets({1, -1}, 25), Error);
  // parallelism.fsdp_bucket_mb: MB, -1 = automatic (25 MB), anything else negative refused.
  EXPECT_EQ(models::resolve_fsdp_bucket_mb(0), 0);
  EXPECT_EQ(models::resolve_fsdp_bucket_mb(0.5), 512 * 1024);
  EXPECT_EQ(models::resolve_fsdp_bucket_mb(models::kAutoBucketMb), models::kAutoBucketBytes);
  EXPECT_THROW(models::resolve_fsdp_bucket_mb(-2), UsageError);
}

llama3::ModelArgs four_layer_args() {
  llama3::ModelArgs a = loom::testing::tiny_llama_args();
  a.n_layers = 4;  // two buckets of two blocks, and room for a prefetch depth of 2
  return a;
}

// The model's parameter names -> values, whole.
std::map<std::string, torch::Tensor> named_values(llama3::Transformer& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.name] = p.tensor().detach().clone();
  return out;
}

TEST(FSDPBuckets, BucketedGroupsKeepTheModelsNamesAndTrainThroughTheFusedHead) {
  auto reference = std::make_shared<llama3::Transformer>(four_layer_args());
  reference->init_weights(3);
  auto model = std::make_shared<llama3::Transformer>(four_layer_args(), torch::TensorOptions().device(torch::kMeta));
  // One block's parameters, so that a target of 1.5 blocks merges pairs.
  int64_t block_bytes = 0;
  for (const auto& p : reference->layers().submodule("0").named_parameters()) block_bytes += p.tensor().nbytes();
  auto fsdp = models::apply_fsdp(*model, FSDPMesh::single(), FSDPPolicy{}, {.bucket_bytes = block_bytes * 3 / 2});
  models::init_sharded_weights(*model, *fsdp, 3);

  std::vector<std::string> groups;
  for (FSDPParamGroup* g : fsdp->param_groups()) groups.push_back(g->name());
  EXPECT_EQ(groups, (std::vector<std::string>{"root", "layers.0..1", "layers.2..3", "head"}));
  EXPECT_EQ(fsdp->states()[1]->modules().size(), 2u);
  EXPECT_EQ(fsdp_state(model->layers().submodule("1")), fsdp->states()[1]);
  // Names are the model's: the same checkpoint keys as one group per block, or no FSDP at all.
  const auto want = named_values(*reference);
  const auto full = fsdp->full_state_dict();
  ASSERT_EQ(full.size(), want.size());
  for (const auto& [name, value] : want) {
    ASSERT_TRUE(full.count(name)) << name;
    EXPECT_TRUE(torch::equal(full.at(name), value)) << name;
  }
  std::set<std::string> sharded;
  for (const auto& t : fsdp->sharded_state_dict()) sharded.insert(t.name);
  EXPECT_EQ(sharded.size(), want.size());
  EXPECT_TRUE(sharded.count("layers.3.feed_forward.w2.weight"));

  // The fused head + loss reads output.weight between the head group's hooks: gathered for it,
  // gradients into the group's buffer. One rank: the shards are the whole gradients.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const torch::Tensor tokens = torch::randint(0, 128, {2, 9}, gen);
  const torch::Tensor input = tokens.narrow(1, 0, 8), labels = tokens.narrow(1, 1, 8);
  const torch::Tensor loss = model->forward_loss(input, labels);
  const torch::Tensor ref_loss = reference->forward_loss(input, labels);
  EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-6);
  loss.backward();
  ref_loss.backward();
  fsdp->finalize_backward();
  EXPECT_EQ(fsdp->unsharded_bytes_allocated(), 0);
  for (FSDPParamGroup* g : fsdp->param_groups()) {
    for (const auto& p : g->params()) {
      const std::string name = fsdp->param_fqn(*g, p);
      const torch::Tensor ref_grad = reference->parameter(name).grad();
      ASSERT_TRUE(ref_grad.defined()) << name;
      EXPECT_TRUE(torch::allclose(p.sharded_grad.view(ref_grad.sizes()), ref_grad, 1e-5, 1e-7)) << name;
    }
  }
}

// Which groups' all-gathers are issued (or done) when each block starts its forward, by block.
std::vector<std::vector<bool>> gathered_at_each_block(int depth) {
  auto model = std::make_shared<llama3::Transformer>(four_layer_args());
  model->init_weights(1);
  FSDPPolicy policy;
  policy.prefetch_depth = depth;
  auto fsdp = models::apply_fsdp(*model, FSDPMesh::single(), policy);
  std::vector<FSDPParamGroup*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(fsdp_state(model->layers().submodule(std::to_string(i)))->param_group());
  std::vector<std::vector<bool>> seen;
  std::vector<nn::HookHandle> probes;
  for (int i = 0; i < 4; ++i) {
    // Registered after FSDP's pre-hook, so it runs after the block's own gather and prefetches.
    probes.push_back(model->layers().submodule(std::to_string(i)).add_forward_pre_hook([&](nn::Module&, torch::Tensor in) {
      std::vector<bool> row;
      for (FSDPParamGroup* g : blocks) row.push_back(g->is_gathering() || g->is_unsharded());
      seen.push_back(row);
      return in;
    }));
  }
  const torch::Tensor tokens = torch::zeros({1, 4}, torch::kLong);
  torch::NoGradGuard no_grad;
  model->forward(tokens);  // records the order: no prefetch yet
  seen.clear();
  model->forward(tokens);
  for (auto& h : probes) h.remove();
  return seen;
}

TEST(FSDPBuckets, PrefetchDepthIssuesTheNextGroupsAllGathersAhead) {
  // Depth 1: while block i runs, block i + 1's gather is in flight (FSDP2's prefetch).
  EXPECT_EQ(gathered_at_each_block(1), (std::vector<std::vector<bool>>{
                                           {1, 1, 0, 0}, {0, 1, 1, 0}, {0, 0, 1, 1}, {0, 0, 0, 1}}));
  // Depth 2: blocks i + 1 and i + 2 (the root's pre-forward already issued blocks 0 and 1).
  EXPECT_EQ(gathered_at_each_block(2), (std::vector<std::vector<bool>>{
                                           {1, 1, 1, 0}, {0, 1, 1, 1}, {0, 0, 1, 1}, {0, 0, 0, 1}}));
  // Depth 0: each block gathers when it is reached.
  EXPECT_EQ(gathered_at_each_block(0), (std::vector<std::vector<bool>>{
                                           {1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}, {0, 0, 0, 1}}));
}

TEST(FSDPBuckets, SeveralModulesInOneGroupAreCheckedUpFront) {
  auto model = std::make_shared<llama3::Transformer>(four_layer_args());
  nn::Module& b0 = model->layers().submodule("0");
  nn::Module& b1 = model->layers().submodule("1");
  EXPECT_THROW(fully_shard(std::vector<std::pair<std::string, nn::Module*>>{}, FSDPMesh::single()), Error);
  EXPECT_THROW(fully_shard({{"layers.0", &b0}, {"layers.0b", &b0}}, FSDPMesh::single()), Error);  // twice
  EXPECT_THROW(fully_shard({{"layers.0", &b0}, {"layers.0", &b1}}, FSDPMesh::single()), Error);   // same path
  EXPECT_THROW(fully_shard({{"", &b0}, {"", &b1}}, FSDPMesh::single()), Error);                   // no paths
  // One module inside another of the list.
  EXPECT_THROW(fully_shard({{"layers", &model->layers()}, {"layers.1", &b1}}, FSDPMesh::single()), Error);
  // Paths that are not where the root finds the modules: caught when the root collects them.
  auto other = std::make_shared<llama3::Transformer>(four_layer_args());
  fully_shard({{"blocks.0", &other->layers().submodule("0")}, {"blocks.1", &other->layers().submodule("1")}},
              FSDPMesh::single());
  EXPECT_THROW(fully_shard(*other, FSDPMesh::single()), Error);
  FSDPPolicy policy;
  policy.prefetch_depth = -1;
  EXPECT_THROW(fully_shard(model->layers().submodule("2"), FSDPMesh::single(), policy), UsageError);
}

}  // namespace loom::fsdp::bucket_tests
