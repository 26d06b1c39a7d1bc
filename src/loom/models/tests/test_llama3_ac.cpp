// models::apply_ac (activation checkpointing of the TransformerBlocks) with FSDP, in one process:
// the blocks are fully_shard-ed with reshard after forward, so backward re-gathers each block
// before its gradient is computed; the checkpointed block's recompute must read those re-gathered
// parameters (it would fail on the 1-D shards otherwise), accumulate into FSDP's gradient buffer
// through the same hooks (a second reduce-scatter of a group would throw; a missed one would leave
// zeros) and give bitwise the gradients of no checkpointing. A one-rank group does not count its
// collectives; the count with 2 ranks (comm_bytes per step equal with and without AC) is checked
// by the Trainer test (train/tests/test_trainer_ac.cpp).
#include <gtest/gtest.h>

#include "loom/testing/tiny_llama.h"
#include "loom/ac/activation_checkpoint.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/spec.h"

namespace {
using namespace loom;

llama3::ModelArgs ac_test_args() {
  llama3::ModelArgs a = loom::testing::tiny_llama_args();
  a.n_layers = 4;
  a.max_seq_len = 32;
  return a;
}

struct Outcome {
  std::vector<torch::Tensor> grads;  // every FSDP group's gradient shard
  int64_t unsharded_after = -1;  // bytes FSDP still holds gathered after the step
  torch::Tensor loss;
};

Outcome train_step(const ac::ACOptions& options, int64_t expect_wrapped) {
  torch::set_num_threads(1);
  auto model = std::make_shared<llama3::Transformer>(ac_test_args(), torch::TensorOptions().device(torch::kMeta));
  EXPECT_EQ(models::apply_ac(*model, options), expect_wrapped);
  fsdp::FSDPPolicy policy;  // reshard after forward: backward all-gathers every block again
  auto fsdp = models::apply_fsdp(*model, fsdp::FSDPMesh::single(), policy, {.reshard_last_block = true});
  models::init_sharded_weights(*model, *fsdp, 5);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const torch::Tensor tokens = torch::randint(0, 128, {2, 24}, gen);
  const torch::Tensor labels = torch::randint(0, 128, {2, 24}, gen);
  Outcome out;
  for (int step = 0; step < 2; ++step) {  // the second step runs with FSDP's recorded prefetch order
    fsdp->zero_grad();
    out.loss = model->forward_loss(tokens, labels);
    out.loss.backward();
    fsdp->finalize_backward();
    out.unsharded_after = fsdp->unsharded_bytes_allocated();
  }
  for (auto* g : fsdp->param_groups()) out.grads.push_back(g->sharded_grads().clone());
  return out;
}

TEST(Llama3AC, UnderFSDPTheRecomputeUsesTheBackwardGatherAndGradientBuffer) {
  const Outcome want = train_step(ac::ACOptions{}, 0);
  EXPECT_EQ(want.unsharded_after, 0);
  const std::vector<std::pair<std::string, std::pair<ac::ACOptions, int64_t>>> modes = {
      {"full", {ac::ACOptions::from({loom::ac::Mode::kFull, ""}), 4}},
      {"selective 2", {ac::ACOptions::from({loom::ac::Mode::kSelective, "2"}), 2}},
      {"selective op", {ac::ACOptions::from({loom::ac::Mode::kSelective, "op"}), 4}},
  };
  for (const auto& [name, mode] : modes) {
    const Outcome got = train_step(mode.first, mode.second);
    EXPECT_TRUE(torch::equal(got.loss, want.loss)) << name;
    EXPECT_EQ(got.unsharded_after, 0) << name << ": every group resharded after backward";
    ASSERT_EQ(got.grads.size(), want.grads.size());
    for (size_t i = 0; i < want.grads.size(); ++i) {
      EXPECT_TRUE(torch::equal(got.grads[i], want.grads[i])) << name << ": group " << i;
    }
  }
}

TEST(Llama3AC, SelectiveEveryNthBlockCountsLayerIds) {
  auto model = std::make_shared<llama3::Transformer>(ac_test_args(), torch::TensorOptions().device(torch::kMeta));
  // A pipeline stage keeps the whole model's layer ids: without layers 0 and 1, "every 2nd block"
  // still means layer 3 (of the remaining 2 and 3), as in the whole model.
  model->layers().remove_module("0");
  model->layers().remove_module("1");
  EXPECT_EQ(models::apply_ac(*model, ac::ACOptions::from({loom::ac::Mode::kSelective, "2"})), 1);
  EXPECT_FALSE(model->layers().submodule("2").forward_override());
  EXPECT_TRUE(model->layers().submodule("3").forward_override());
}

}  // namespace
