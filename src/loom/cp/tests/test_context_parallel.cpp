// Context parallelism: head-tail sharding (one process) and ring / all-gather attention against
// whole-sequence attention on 1, 2 and 4 ranks (tests/worker/cp_worker.cpp: output and q, k, v
// gradients within 1e-5, with and without GQA).
#include <gtest/gtest.h>

#include "loom/core/error.h"
#include "loom/cp/ring_attention.h"
#include "loom/testing/errors.h"
#include "loom/testing/worker.h"

namespace {

void expect_workers(int nproc) { loom::testing::expect_workers("loom_cp_worker", "attention", nproc); }

}  // namespace

// Rank i of c holds chunks i and 2c-1-i of 2c: every rank the same causal work.
TEST(ContextParallel, HeadTailShardingBalancesCausalWork) {
  EXPECT_EQ(loom::cp::chunk_ids(0, 4), (std::vector<int64_t>{0, 7}));
  EXPECT_EQ(loom::cp::chunk_ids(3, 4), (std::vector<int64_t>{3, 4}));
  const torch::Tensor pos = loom::cp::sequence_positions(16, 1, 2);  // chunks 1 and 2 of 4, 4 tokens each
  EXPECT_TRUE(torch::equal(pos, torch::tensor({4, 5, 6, 7, 8, 9, 10, 11}, torch::kInt64)));
  // Together the ranks hold every position once.
  std::vector<torch::Tensor> all;
  for (int r = 0; r < 4; ++r) all.push_back(loom::cp::sequence_positions(32, r, 4));
  EXPECT_TRUE(torch::equal(std::get<0>(torch::cat(all).sort()), torch::arange(32, torch::kInt64)));
  loom::testing::expect_error<loom::UsageError>(
      [] { loom::cp::shard_sequence(torch::zeros({2, 30}), 1, 0, 4); },
      {"context parallel degree 4 needs the sequence length to be divisible by 2 x 4 = 8, got 30"});
  loom::testing::expect_error<loom::UsageError>([] {
        loom::options::parse_enum<loom::cp::RotateMethod>("alltoall", "parallelism.context_parallel_rotate_method");
      },
      {"parallelism.context_parallel_rotate_method must be \"allgather\" or \"ring\", got \"alltoall\""});
}

// One rank: ring attention is whole-sequence causal attention.
TEST(ContextParallel, OneRankIsPlainCausalAttention) {
  const torch::Tensor q = torch::randn({1, 4, 16, 8}), k = torch::randn({1, 2, 16, 8}), v = torch::randn({1, 2, 16, 8});
  const auto comm = loom::distributed::Comm::single("cp", 0);
  const torch::Tensor want = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true, std::nullopt, true);
  for (auto method : {loom::cp::RotateMethod::kRing, loom::cp::RotateMethod::kAllGather}) {
    EXPECT_LE((loom::cp::ring_attention(q, k, v, comm, method) - want).abs().max().item<double>(), 1e-6);
  }
}

TEST(ContextParallel, RingAttentionMatchesWholeSequenceOnTwoRanks) { expect_workers(2); }
TEST(ContextParallel, RingAttentionMatchesWholeSequenceOnFourRanks) { expect_workers(4); }
// GPT-OSS's sinks and sliding window (below, at and above a chunk's length; with documents):
// tests/worker/cp_worker.cpp's "features" scenario against an explicit float64 softmax.
TEST(ContextParallel, RingAttentionWithSinksAndWindowOnTwoRanks) {
  loom::testing::expect_workers("loom_cp_worker", "features", 2);
}
TEST(ContextParallel, RingAttentionWithSinksAndWindowOnFourRanks) {
  loom::testing::expect_workers("loom_cp_worker", "features", 4);
}
// One rank: the sinks and window in ring attention's merge, against the same explicit softmax.
TEST(ContextParallel, RingAttentionWithSinksAndWindowOnOneRank) {
  loom::testing::expect_workers("loom_cp_worker", "features", 1);
}
