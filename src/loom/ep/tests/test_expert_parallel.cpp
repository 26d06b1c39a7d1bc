// Expert parallelism: the experts' sharding and volume formula (one process), and the EP MoE layer
// against the whole layer on 2 and 4 ranks (tests/worker/ep_worker.cpp: outputs, input, router and
// expert gradients within 1e-5; experts and whole ranks without tokens; the all-to-all bytes equal
// to the formula; GPT-OSS's options: router and expert biases, the clamped SwiGLU).
#include <gtest/gtest.h>

#include "loom/core/error.h"
#include "loom/distributed/process_group.h"
#include "loom/ep/expert_parallel.h"
#include "loom/testing/errors.h"
#include "loom/testing/worker.h"

namespace ep_tests {

void expect_workers(const std::string& scenario, int nproc) {
  loom::testing::expect_workers("loom_ep_worker", scenario, nproc);
}

loom::moe::MoEOptions options(int64_t experts) {
  loom::moe::MoEOptions o;
  o.router.n_experts = experts;
  o.router.top_k = 2;
  o.hidden_dim = 6;
  return o;
}

}  // namespace ep_tests

TEST(ExpertParallel, OneRankKeepsEveryExpertAndTheLayerUnchanged) {
  auto comm = loom::distributed::Comm::single("ep", 0);
  auto layer = std::make_shared<loom::moe::MoE>(8, ep_tests::options(4), torch::TensorOptions());
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : layer->named_parameters()) p.slot->tensor.normal_();
  }
  const torch::Tensor x = torch::randn({10, 8});
  const torch::Tensor before = layer->forward(x);
  loom::ep::ExpertParallel ep(comm);
  ep.apply(*layer, "layers.1.moe");
  EXPECT_TRUE(ep.is_sharded("layers.1.moe.experts.w2"));
  const auto& layout = *layer->experts().parameter_slot("w1").layout;
  EXPECT_EQ(layout.describe(), "[4, 6, 8] ep:Shard(0)");
  EXPECT_TRUE(torch::equal(layer->forward(x), before));
}

TEST(ExpertParallel, DispatchBytesFollowTheFormula) {
  // 8 experts over 2 ranks: rank 1 holds experts 4-7. Rank 1 routes 1 + 2 tokens to rank 0's
  // experts and receives 3 + 4 from rank 0 for its own.
  const std::vector<std::vector<int64_t>> counts = {{5, 0, 0, 0, 3, 0, 4, 0}, {1, 0, 2, 0, 6, 6, 0, 0}};
  const int64_t dim = 16, bytes = 4;
  EXPECT_EQ(loom::ep::dispatch_wire_bytes(counts, 1, dim, bytes), 8 * 4 + 2 * (3 + 7) * dim * bytes);
  EXPECT_EQ(loom::ep::dispatch_wire_bytes(counts, 0, dim, bytes), 8 * 4 + 2 * (7 + 3) * dim * bytes);
  EXPECT_EQ(loom::ep::dispatch_wire_bytes({{1, 2}}, 0, dim, bytes), 0);  // one rank sends nothing
}

TEST(ExpertParallel, MatchesTheWholeLayerOnTwoRanks) { ep_tests::expect_workers("dispatch", 2); }
TEST(ExpertParallel, MatchesTheWholeLayerOnFourRanks) { ep_tests::expect_workers("dispatch", 4); }
TEST(ExpertParallel, StarvedExpertsAndRanksOnTwoRanks) { ep_tests::expect_workers("starved", 2); }
TEST(ExpertParallel, StarvedExpertsAndRanksOnFourRanks) { ep_tests::expect_workers("starved", 4); }

// GPT-OSS's options: the expert biases travel with their experts' shards (each rank's b1, b2, b3
// gradients the sum over every rank's tokens routed to them), the router's bias stays replicated.
TEST(ExpertParallel, GptOssOptionsMatchTheWholeLayerOnTwoRanks) { ep_tests::expect_workers("gpt_oss", 2); }
TEST(ExpertParallel, GptOssOptionsMatchTheWholeLayerOnFourRanks) { ep_tests::expect_workers("gpt_oss", 4); }

// Six SGD steps of GPT-OSS's layer on EP 2 against one process that sees every rank's tokens: the
// loss and gradient norm of each step, and the parameters after them, within 1e-5 (relative).
TEST(ExpertParallel, GptOssStepsMatchOneProcessOnTwoRanks) { ep_tests::expect_workers("gpt_oss_steps", 2); }

// EP 2 x FSDP 2 of the experts (4 ranks): one forward and backward of GPT-OSS's layer against one
// process on every rank's tokens: loss, gradient norm, and every rank's gradient shard of each
// expert stack (biases included) and of the router, within 1e-5 (relative).
TEST(ExpertParallel, GptOssWithFsdpOfTheExpertsMatchesOneProcessOnFourRanks) {
  ep_tests::expect_workers("gpt_oss_efsdp", 4);
}

TEST(ExpertParallel, ShardsGptOssExpertBiasesWithTheirExperts) {
  auto comm = loom::distributed::Comm::single("ep", 0);
  loom::moe::MoEOptions o = ep_tests::options(4);
  o.router.gate_bias = true;
  o.experts.bias = true;
  auto layer = std::make_shared<loom::moe::MoE>(8, o, torch::TensorOptions());
  loom::ep::ExpertParallel ep(comm);
  ep.apply(*layer, "layers.1.moe");
  for (const char* b : {"b1", "b2", "b3"}) {
    EXPECT_TRUE(ep.is_sharded(std::string("layers.1.moe.experts.") + b)) << b;
  }
  EXPECT_EQ(layer->experts().parameter_slot("b2").layout->describe(), "[4, 8] ep:Shard(0)");
  EXPECT_FALSE(ep.is_sharded("layers.1.moe.router.gate.bias"));
  EXPECT_FALSE(layer->router().gate().parameter_slot("bias").layout);
}
