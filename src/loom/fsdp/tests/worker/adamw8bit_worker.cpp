// Per-rank scenario of the AdamW8bit FSDP test (test_adamw8bit_fsdp.cpp), started as
//   loom launch --nproc W --exec -- loom_fsdp_adamw8bit_worker adamw8bit
// A tiny Llama is fully_shard-ed over all W ranks with AdamW8bit's block granularity; every rank
// then feeds fsdp::ShardedAdamW8bit the same whole gradients (seeded, written into its gradient
// shards) for a few steps and checks that the gathered parameters equal, bitwise, those of
// optim::AdamW8bit stepping the unsharded model in this process with the same gradients.
#include <algorithm>
#include <cstdio>

#include "loom/testing/tiny_llama.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/fsdp/sharded_optimizer.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/spec.h"
#include "loom/optim/adamw8bit.h"
#include "loom/testing/worker.h"

namespace {
using namespace loom;

constexpr int64_t kBlock = 256;
constexpr int kSteps = 4;
constexpr int64_t kSeqLen = 8;

llama3::ModelArgs tiny_args() {
  // dim 64: 64 x 64 = 4096-element projections, the smallest that are quantized.
  llama3::ModelArgs a = loom::testing::tiny_llama_args();
  a.n_kv_heads = 4;  // wk, wv 64 x 64: quantized too
  a.max_seq_len = kSeqLen;
  return a;
}

// The gradient of parameter `name` at `step`: the same on every rank, of varying scale so blocks
// see very different absmax values.
torch::Tensor gradient_of(const std::string& name, const std::vector<int64_t>& shape, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(std::hash<std::string>{}(name) + 977 * step);
  torch::Tensor g = torch::randn(shape, gen);
  return g * torch::pow(10.0, torch::randint(-4, 1, shape, gen).to(torch::kFloat));
}

void run(const std::shared_ptr<distributed::Comm>& world) {
  const optim::AdamWOptions options{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  constexpr double kWeightDecay = 0.1;

  // The unsharded reference.
  auto reference = std::make_shared<llama3::Transformer>(tiny_args());
  reference->init_weights(3);
  optim::NamedTensors named;
  for (const auto& p : reference->named_parameters()) named.emplace_back(p.name, p.slot->tensor);
  optim::AdamW8bit single(optim::weight_decay_param_groups(named, kWeightDecay), options, kBlock);

  auto model = std::make_shared<llama3::Transformer>(tiny_args());
  model->init_weights(3);
  fsdp::FSDPPolicy policy;
  policy.parameter_granularity = fsdp::adamw8bit_granularity(kBlock);
  fsdp::FSDPMesh mesh;
  mesh.shard = world;
  auto root = models::apply_fsdp(*model, mesh, policy);
  fsdp::ShardedAdamW8bit sharded(root, options, kWeightDecay, kBlock);

  // The layout must actually cut quantized parameters between ranks, at block boundaries.
  int64_t cut = 0;
  for (fsdp::FSDPParamGroup* g : root->param_groups()) {
    for (const auto& p : g->params()) {
      const auto& t = g->plan().tensors[p.index];
      if (!optim::is_block_quantized(t.numel, kBlock)) continue;
      LOOM_REQUIRE(t.shard.granule_elems == kBlock, p.name, " planned with granule ",
                   t.shard.granule_elems);
      int64_t holders = 0;
      for (int64_t u : t.shard.units_per_rank) holders += u > 0;
      cut += holders > 1;
    }
  }
  LOOM_REQUIRE(world->size() == 1 || cut > 0, "no quantized parameter is split across ranks");

  const auto tokens = torch::randint(0, 128, {2, kSeqLen + 1},
                                     at::make_generator<at::CPUGeneratorImpl>(5));
  for (int step = 0; step < kSteps; ++step) {
    // A backward marks the gradient shards as reduced; their values are then replaced by the
    // seeded whole gradients' pieces, so both optimizers see identical gradients.
    sharded.zero_grad();
    auto logits = model->forward(tokens.narrow(1, 0, kSeqLen));
    torch::nn::functional::cross_entropy(logits.flatten(0, 1),
                                         tokens.narrow(1, 1, kSeqLen).flatten())
        .backward();
    root->finalize_backward();
    torch::NoGradGuard no_grad;
    for (fsdp::FSDPParamGroup* g : root->param_groups()) {
      for (const auto& p : g->params()) {
        const auto& t = g->plan().tensors[p.index];
        const auto range = g->params_buffer().global_range(p.index);
        const torch::Tensor full = gradient_of(root->param_fqn(*g, p), t.shape, step);
        torch::Tensor dst = p.sharded_grad;
        dst.view(-1).copy_(full.view(-1).narrow(0, range.begin, range.size()));
      }
    }
    for (const auto& p : reference->named_parameters()) {
      p.slot->tensor.mutable_grad() = gradient_of(p.name, p.slot->tensor.sizes().vec(), step);
    }
    sharded.step();
    single.step();
  }

  const optim::TensorDict gathered = root->full_state_dict();
  int64_t checked = 0;
  for (const auto& p : reference->named_parameters()) {
    const torch::Tensor& want = p.slot->tensor;
    const torch::Tensor& got = gathered.at(p.name);
    LOOM_REQUIRE(torch::equal(got, want), "parameter ", p.name, " differs from the single-process "
                 "AdamW8bit update: max |diff| ", (got - want).abs().max().item<double>());
    checked += want.numel();
  }
  // AdamW8bit moved the parameters (a no-op update would pass the comparison too).
  auto fresh = std::make_shared<llama3::Transformer>(tiny_args());
  fresh->init_weights(3);
  double moved = 0;
  for (const auto& p : fresh->named_parameters()) {
    moved = std::max(moved, (gathered.at(p.name) - p.slot->tensor).abs().max().item<double>());
  }
  LOOM_REQUIRE(moved > 1e-3, "the parameters barely moved (", moved, ")");
  if (world->rank() == 0) {
    std::printf("FSDP %d: %lld parameters after %d AdamW8bit steps bitwise equal to one process "
                "(%lld quantized parameters cut across ranks; state %lld bytes on rank 0)\n",
                world->size(), static_cast<long long>(checked), kSteps, static_cast<long long>(cut),
                static_cast<long long>(sharded.state_nbytes()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  return loom::testing::worker_main(argc, argv, {{"adamw8bit", run}});
}
