// Single-process tests of the FSDP building blocks: DistributedBuffer layout and views (W ranks
// simulated in one process), memory release under live views and saved tensors, in-place
// gradient accumulation into the flat buffer, and fully_shard on a one-rank mesh against the
// unwrapped model.
#include <gtest/gtest.h>

#include "loom/testing/tiny_llama.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/fsdp/distributed_buffer.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/fsdp/sharded_optimizer.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/spec.h"
#include "loom/nn/layers.h"
#include "loom/optim/adamw.h"
#include "loom/optim/clip_grad.h"

namespace loom::fsdp {
namespace {

constexpr int64_t kMiB = 1024 * 1024;

// Rows of 12 elements do not tile a 40-element shard, so row granularity leaves padding inside
// tensors: "split" tensors whose unsharded value lives in the side buffer.
GroupSpec split_prone_group() {
  GroupSpec g;
  g.name = "test";
  g.tensors = {{"a", {5, 12}, 4, tensor::Granularity::row()},
               {"b", {7, 12}, 4, tensor::Granularity::row()},
               {"c", {3}, 4, tensor::Granularity::element()}};
  return g;
}

std::vector<torch::Tensor> random_values(const Plan& plan, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<torch::Tensor> out;
  for (const auto& t : plan.tensors) out.push_back(torch::randn(t.shape, gen));
  return out;
}

// Positions of the W·S buffer that belong to no tensor.
torch::Tensor padding_mask(const Plan& plan, const std::vector<DistributedBuffer>& ranks) {
  torch::Tensor used = torch::zeros({plan.buffer_elems()}, torch::kBool);
  for (const auto& b : ranks) {
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
      const auto r = b.local_range(i);
      used.narrow(0, b.rank() * plan.shard_elems + r.begin, r.size()).fill_(true);
    }
  }
  return used.logical_not();
}

TEST(DistributedBuffer, ShardsViewsAndSplitTensorsOverSimulatedRanks) {
  const int64_t W = 4;
  const Plan plan = plan_group(split_prone_group(), W);
  const auto full = random_values(plan, 1);
  std::vector<DistributedBuffer> ranks;
  ranks.reserve(W);
  for (int64_t r = 0; r < W; ++r) {
    ranks.emplace_back(plan, r, torch::kFloat32, torch::kFloat32);
    for (size_t i = 0; i < full.size(); ++i) ranks.back().write_shard_from_full(i, full[i]);
  }
  ASSERT_GT(ranks[0].num_split_tensors(), 0) << "the layout should cut tensors with padding";
  EXPECT_FALSE(ranks[0].is_split(2));  // element granularity is never split

  // Sharded views: whole rows keep the row shape and hold the right rows.
  for (int64_t r = 0; r < W; ++r) {
    for (size_t i = 0; i < full.size(); ++i) {
      const auto g = ranks[r].global_range(i);
      const torch::Tensor view = ranks[r].sharded_view(i);
      EXPECT_EQ(view.numel(), g.size());
      EXPECT_TRUE(
          torch::equal(view.reshape({-1}), full[i].reshape({-1}).narrow(0, g.begin, g.size())));
      EXPECT_EQ(view.dim(), i < 2 ? 2 : 1);
    }
  }

  // All-gather = concatenation of the shards; padding is zero everywhere.
  std::vector<torch::Tensor> shards;
  for (auto& b : ranks) shards.push_back(b.sharded());
  const torch::Tensor gathered = torch::cat(shards);
  const torch::Tensor pad = padding_mask(plan, ranks);
  EXPECT_GT(pad.sum().item<int64_t>(), 0);
  EXPECT_EQ(gathered.masked_select(pad).abs().sum().item<double>(), 0.0);
  for (size_t i = 0; i < full.size(); ++i) {
    EXPECT_TRUE(torch::equal(ranks[0].full_from_gathered(i, gathered), full[i]));
  }

  DistributedBuffer& b = ranks[1];
  EXPECT_FALSE(b.unsharded_allocated());
  b.allocate_unsharded();
  b.unsharded().copy_(gathered);
  b.copy_out_split_tensors();
  for (size_t i = 0; i < full.size(); ++i) {
    EXPECT_TRUE(torch::equal(b.unsharded_view(i), full[i])) << plan.tensors[i].name;
    EXPECT_TRUE(torch::equal(b.unsharded_alias(i), full[i])) << plan.tensors[i].name;
  }
  EXPECT_TRUE(torch::equal(b.unsharded_rank_slice(), b.sharded()));

  // Reduce-scatter: every rank writes gradients through the full-shape views, the split ones go
  // back to their pieces, and rank r's slice of the sum is its gradient shard.
  torch::Tensor sum = torch::zeros({plan.buffer_elems()});
  for (int64_t r = 0; r < W; ++r) {
    ranks[r].allocate_unsharded();
    ranks[r].zero_unsharded();
    for (size_t i = 0; i < full.size(); ++i) ranks[r].unsharded_view(i).copy_(full[i] * (r + 1));
    ranks[r].copy_in_split_tensors();
    sum += ranks[r].unsharded();
  }
  EXPECT_EQ(sum.masked_select(pad).abs().sum().item<double>(), 0.0);
  for (int64_t r = 0; r < W; ++r) {
    const torch::Tensor shard = sum.narrow(0, r * plan.shard_elems, plan.shard_elems);
    for (size_t i = 0; i < full.size(); ++i) {
      const auto local = ranks[r].local_range(i);
      const auto g = ranks[r].global_range(i);
      EXPECT_TRUE(torch::allclose(shard.narrow(0, local.begin, local.size()),
                                  (full[i] * 10).reshape({-1}).narrow(0, g.begin, g.size())));
    }
    ranks[r].release_unsharded();
    EXPECT_EQ(ranks[r].allocated_bytes(), plan.shard_elems * 4);
  }
}

TEST(DistributedBuffer, RejectsAWrongFullShape) {
  const Plan plan = plan_group(split_prone_group(), 2);
  DistributedBuffer b(plan, 0, torch::kFloat32, torch::kBFloat16);
  EXPECT_THROW(b.write_shard_from_full(0, torch::zeros({12, 5})), Error);
  EXPECT_THROW(DistributedBuffer(plan, 2, torch::kFloat32, torch::kFloat32), Error);
}

TEST(ReleasableBuffer, ReleaseReturnsMemoryAndViewsSeeTheNextAllocation) {
  const int64_t numel = 64 * kMiB / 4;
  ReleasableBuffer buf(numel, torch::kFloat32);
  buf.flat().fill_(1.0f);  // touch every page
  const torch::Tensor alias = buf.alias(0, {numel / 2, 2});
  const torch::Tensor view = buf.flat().narrow(0, 8, 8);
  buf.release();
  EXPECT_FALSE(buf.allocated());
  EXPECT_EQ(alias.sizes(), torch::IntArrayRef({numel / 2, 2}));

  buf.allocate();
  buf.flat().fill_(2.0f);
  EXPECT_EQ(alias[7][1].item<float>(), 2.0f);
  EXPECT_EQ(view[3].item<float>(), 2.0f);
  // The alias has its own version counter: writes through the buffer do not bump it.
  const auto version = alias._version();
  buf.flat().add_(1.0f);
  EXPECT_EQ(alias._version(), version);
  EXPECT_EQ(alias[0][0].item<float>(), 3.0f);
}

TEST(ReleasableBuffer, ReleasedMemoryServesTheNextBufferOfItsSizeAndLeavesWithTheLast) {
  // FSDP releases a block's unsharded buffer after its forward and the next block, of the same
  // size, gathers right after: it must get the same (already resident) memory, not fresh pages.
  const int64_t numel = 64 * kMiB / 4;
  const int64_t before = memory::current_rss_bytes();
  {
    ReleasableBuffer first(numel, torch::kFloat32);
    first.flat().fill_(1.0f);  // touch every page
    const void* memory = first.flat().data_ptr();
    const int64_t resident = memory::current_rss_bytes();
    EXPECT_GT(resident - before, 48 * kMiB);
    first.release();
    ReleasableBuffer second(numel, torch::kFloat32);
    EXPECT_EQ(second.flat().data_ptr(), memory);
    second.flat().fill_(2.0f);
    EXPECT_LT(memory::current_rss_bytes() - resident, 16 * kMiB);
    second.release();
    // A buffer of another size does not take it; the next one of its size does.
    ReleasableBuffer other(numel / 2, torch::kFloat32);
    EXPECT_NE(other.flat().data_ptr(), memory);
    first.allocate();
    EXPECT_EQ(first.flat().data_ptr(), memory);
  }
  // Both buffers of that size are gone: the memory is back with the system.
  EXPECT_LT(memory::current_rss_bytes() - before, 16 * kMiB);
}

// FSDP's unsharded buffers are what memory accounting calls buffers in flight: each reports its
// bytes while allocated, a move hands the account over, destruction closes it, and its memory
// never shows up as tensors.
TEST(ReleasableBuffer, ReportsItsBytesAsABufferInFlight) {
  memory::AllocationTracker tracker;
  const int64_t n = 1 << 18, bytes = n * 4;
  {
    ReleasableBuffer buffer(n, torch::kFloat32);
    EXPECT_EQ(tracker.comm_buffer_bytes(), bytes);
    buffer.release();
    EXPECT_EQ(tracker.comm_buffer_bytes(), 0);
    buffer.allocate();
    EXPECT_EQ(tracker.comm_buffer_bytes(), bytes);
    ReleasableBuffer moved(std::move(buffer));
    EXPECT_EQ(tracker.comm_buffer_bytes(), bytes);
    ReleasableBuffer other(n / 2, torch::kFloat32);
    EXPECT_EQ(tracker.comm_buffer_bytes(), bytes + bytes / 2);
    other = std::move(moved);  // `other`'s own buffer is dropped
    EXPECT_EQ(tracker.comm_buffer_bytes(), bytes);
    EXPECT_EQ(tracker.current_bytes(), tracker.comm_buffer_bytes());  // no tensor bytes
  }
  EXPECT_EQ(tracker.comm_buffer_bytes(), 0);
  EXPECT_EQ(tracker.peak().comm_buffers, bytes + bytes / 2);
}

TEST(ReleasableBuffer, SavedTensorsSurviveReleaseAndRegather) {
  // Autograd saves the weight leaf for backward; releasing its storage frees the memory anyway
  // (the next buffer of its size gets it), and after re-gathering the same values backward gives
  // the right gradients.
  const int64_t rows = 2560, cols = 4096;  // 40 MiB: above glibc's largest mmap threshold
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const torch::Tensor weight = torch::rand({rows, cols}, gen);
  const torch::Tensor x = torch::rand({2, cols}, gen);
  ReleasableBuffer buf(rows * cols, torch::kFloat32);
  buf.flat().copy_(weight.reshape({-1}));
  torch::Tensor leaf = buf.alias(0, {rows, cols}).requires_grad_(true);
  torch::Tensor loss = at::linear(x.requires_grad_(true), leaf).square().sum();

  const void* memory = buf.flat().data_ptr();
  buf.release();
  {
    ReleasableBuffer next(rows * cols, torch::kFloat32);
    EXPECT_EQ(next.flat().data_ptr(), memory);
    next.flat().zero_();
  }
  buf.allocate();
  buf.flat().copy_(weight.reshape({-1}));  // the "all-gather"
  loss.backward();

  torch::Tensor ref_w = weight.clone().requires_grad_(true);
  torch::Tensor ref_x = x.detach().clone().requires_grad_(true);
  at::linear(ref_x, ref_w).square().sum().backward();
  EXPECT_TRUE(torch::allclose(leaf.grad(), ref_w.grad()));
  EXPECT_TRUE(torch::allclose(x.grad(), ref_x.grad()));
}

TEST(ReleasableBuffer, AccumulateGradAddsInPlaceIntoAPresetWiderGrad) {
  // FSDP pre-sets .grad to a view of the flat reduce_dtype buffer; AccumulateGrad must add into
  // it in place even when the parameter is bf16 and the buffer fp32.
  torch::Tensor flat = torch::zeros({10}, torch::kFloat32);
  torch::Tensor leaf = torch::ones({2, 3}, torch::kBFloat16).requires_grad_(true);
  const torch::Tensor view = flat.narrow(0, 2, 6).view({2, 3});
  leaf.mutable_grad() = view;
  (leaf * 3).sum().backward();
  (leaf * 3).sum().backward();
  EXPECT_EQ(leaf.grad().unsafeGetTensorImpl(), view.unsafeGetTensorImpl());
  EXPECT_EQ(leaf.grad().scalar_type(), torch::kFloat32);
  EXPECT_EQ(flat.sum().item<float>(), 36.0f);
  EXPECT_EQ(flat[0].item<float>(), 0.0f);
}

// ---------------------------------------------------------------------------------------------
// fully_shard on one rank

llama3::ModelArgs tiny_args() { return loom::testing::tiny_llama_args(); }

torch::Tensor loss_of(llama3::Transformer& m, const torch::Tensor& tokens) {
  auto logits = m.forward(tokens.narrow(1, 0, tokens.size(1) - 1));
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1),
                                              tokens.narrow(1, 1, tokens.size(1) - 1).flatten());
}

TEST(FullyShard, OneRankTrainsLikeTheUnwrappedModel) {
  auto reference = std::make_shared<llama3::Transformer>(tiny_args());
  reference->init_weights(5);
  // The sharded model starts on the meta device and is initialized shard by shard.
  auto model = std::make_shared<llama3::Transformer>(tiny_args(),
                                                     torch::TensorOptions().device(torch::kMeta));
  FSDPPolicy policy;
  policy.granularity = tensor::Granularity::row();
  auto fsdp = models::apply_fsdp(*model, FSDPMesh::single(), policy);
  models::init_sharded_weights(*model, *fsdp, 5);
  // The root (embedding), the two blocks, and the head (final norm + output) as one group.
  ASSERT_EQ(fsdp->states().size(), 4u);
  EXPECT_TRUE(fsdp->is_root());
  EXPECT_EQ(fsdp->states()[1]->fqn(), "layers.0");
  EXPECT_EQ(fsdp->states()[3]->param_group()->name(), "head");
  EXPECT_EQ(fsdp->states()[3]->modules().size(), 2u);

  const auto initial = fsdp->full_state_dict();
  for (const auto& p : reference->named_parameters()) {
    ASSERT_TRUE(initial.count(p.name)) << p.name;
    EXPECT_TRUE(torch::equal(initial.at(p.name), p.tensor())) << p.name;
  }
  // Outside forward the module's slots hold the shards.
  EXPECT_EQ(model->parameter("layers.0.attention.wq.weight").dim(), 2);
  EXPECT_FALSE(model->parameter("layers.0.attention.wq.weight").requires_grad());

  optim::AdamWOptions options;
  options.lr = 1e-3;
  ShardedAdamW optimizer(fsdp, options, 0.1);
  optim::AdamW ref_optimizer(
      optim::weight_decay_param_groups(
          [&] {
            optim::NamedTensors named;
            for (const auto& p : reference->named_parameters()) {
              named.emplace_back(p.name, p.tensor());
            }
            return named;
          }(),
          0.1),
      options);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  for (int step = 0; step < 3; ++step) {
    const torch::Tensor tokens = torch::randint(0, 128, {2, 9}, gen);
    optimizer.zero_grad();
    ref_optimizer.zero_grad();
    // Two micro-batches accumulated without resync: only the second reduces.
    fsdp->set_requires_gradient_sync(false);
    (loss_of(*model, tokens) * 0.5).backward();
    fsdp->set_requires_gradient_sync(true);
    const torch::Tensor loss = loss_of(*model, tokens);
    (loss * 0.5).backward();
    const torch::Tensor ref_loss = loss_of(*reference, tokens);
    ref_loss.backward();
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-6 * ref_loss.item<double>());
    std::vector<torch::Tensor> ref_grads;
    for (const auto& p : reference->parameters()) ref_grads.push_back(p.grad());
    EXPECT_NEAR(fsdp->clip_grad_norm_(1.0).item<double>(),
                optim::clip_grad_norm_(ref_grads, 1.0).item<double>(), 1e-5);
    optimizer.step();
    ref_optimizer.step();
    EXPECT_EQ(fsdp->unsharded_bytes_allocated(), 0);
  }
  for (const auto& [name, value] : fsdp->full_state_dict()) {
    EXPECT_TRUE(torch::allclose(value, reference->parameter(name), 1e-5, 1e-6)) << name;
  }
  // Per-parameter optimizer state names, shaped like the shards.
  const auto state = optimizer.state_dict();
  EXPECT_EQ(state.size(), 3 * reference->named_parameters().size());
  EXPECT_EQ(state.at("layers.1.feed_forward.w2.weight.exp_avg").sizes(),
            model->parameter("layers.1.feed_forward.w2.weight").sizes());
  EXPECT_EQ(state.at("norm.weight.step").item<float>(), 3.0f);
  optimizer.load_state_dict(state);
  EXPECT_THROW(optimizer.load_state_dict({}), Error);
}

// A module whose forward uses one of its two layers: the unused layer's gradient never arrives,
// so its group's post-backward runs from the end-of-backward callback.
class HalfUsed : public nn::Module {
 public:
  HalfUsed() : nn::Module("HalfUsed") {
    used_ = register_module("used", std::make_shared<nn::Linear>(4, 3, torch::TensorOptions()));
    register_module("unused", std::make_shared<nn::Linear>(4, 3, torch::TensorOptions()));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return call_with_hooks(x, [this](const torch::Tensor& in) { return used_->forward(in); });
  }

 private:
  std::shared_ptr<nn::Linear> used_;
};

TEST(FullyShard, UnusedParametersAreReducedAtTheEndOfBackward) {
  HalfUsed module;
  for (const auto& p : module.named_parameters()) p.slot->tensor.detach().fill_(0.5);
  auto fsdp = fully_shard(module, FSDPMesh::single());
  const torch::Tensor x = torch::ones({2, 4});
  module.forward(x).sum().backward();
  EXPECT_FALSE(fsdp->param_group()->has_pending_reduce());  // reduced by the callback (1 rank)
  EXPECT_TRUE(fsdp->param_group()->has_sharded_grads());
  EXPECT_EQ(fsdp->unsharded_bytes_allocated(), 0);
  for (const auto& p : fsdp->param_group()->params()) {
    // d sum(W x) / dW = the sum of x over the batch of 2 ones; nothing for the unused layer.
    const double want = p.name == "used.weight" ? 2.0 : 0.0;
    EXPECT_TRUE(torch::allclose(p.sharded_grad, torch::full_like(p.sharded_grad, want))) << p.name;
  }
}

TEST(FullyShard, WhatStaysUnshardedWhen) {
  auto model = std::make_shared<llama3::Transformer>(tiny_args());
  model->init_weights(1);
  auto fsdp = models::apply_fsdp(*model, FSDPMesh::single(), FSDPPolicy{});
  FSDPParamGroup* root = fsdp->param_group();
  FSDPParamGroup* block = fsdp->states()[1]->param_group();
  const torch::Tensor tokens = torch::zeros({1, 4}, torch::kLong);

  // Between forward and backward (ZeRO-3): blocks hold nothing, the root keeps its parameters.
  torch::Tensor loss = model->forward(tokens).sum();
  EXPECT_TRUE(root->is_unsharded());
  EXPECT_FALSE(block->is_unsharded());
  EXPECT_EQ(block->unsharded_bytes_allocated(), 0);
  EXPECT_EQ(fsdp->unsharded_bytes_allocated(), root->unsharded_bytes_allocated());
  loss.backward();
  EXPECT_FALSE(root->is_unsharded());
  fsdp->finalize_backward();
  EXPECT_EQ(fsdp->unsharded_bytes_allocated(), 0);

  // Explicit unshard keeps everything gathered until reshard.
  fsdp->unshard();
  EXPECT_GT(fsdp->unsharded_bytes_allocated(), 0);
  EXPECT_EQ(model->parameter("output.weight").sizes(), torch::IntArrayRef({128, 64}));
  fsdp->reshard();
  EXPECT_EQ(fsdp->unsharded_bytes_allocated(), 0);
  {
    torch::NoGradGuard no_grad;
    model->forward(tokens);
  }
  EXPECT_EQ(fsdp->unsharded_bytes_allocated(), 0);  // no backward follows: everything resharded
}

TEST(FullyShard, BadPoliciesAreOneLineErrors) {
  EXPECT_THROW(ReshardAfterForward::parse("sometimes"), UsageError);
  EXPECT_THROW(ReshardAfterForward::degree(0), UsageError);
  EXPECT_THROW(models::FSDPReshardSetting::parse("-2"), UsageError);
  EXPECT_EQ(models::FSDPReshardSetting::parse("default").last_block, false);
  EXPECT_EQ(models::FSDPReshardSetting::parse("4").blocks, ReshardAfterForward::degree(4));

  auto model = std::make_shared<llama3::Transformer>(tiny_args());
  FSDPPolicy policy;
  policy.granularity = tensor::Granularity::row_block(7);  // 7 does not divide dim 64
  try {
    models::apply_fsdp(*model, FSDPMesh::single(), policy);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find("7"), std::string::npos) << msg;
  }
  auto other = std::make_shared<llama3::Transformer>(tiny_args());
  fully_shard(other->layers().submodule("0"), FSDPMesh::single());
  EXPECT_THROW(fully_shard(other->layers().submodule("0"), FSDPMesh::single()), Error);
  policy = FSDPPolicy{};
  policy.reshard_after_forward = ReshardAfterForward::degree(2);  // W = 1
  EXPECT_THROW(fully_shard(other->layers().submodule("1"), FSDPMesh::single(), policy), UsageError);
}

}  // namespace
}  // namespace loom::fsdp
