// Tensor parallelism: the degree checks (one process) and the Llama plan against the
// single-process model on 2 and 4 ranks (tests/worker/tp_worker.cpp: loss and every gradient
// shard, sequence parallel and loss parallel on and off, three SGD steps).
#include <gtest/gtest.h>

#include "loom/core/error.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/spec.h"
#include "loom/testing/errors.h"
#include "loom/testing/worker.h"

namespace {

void expect_usage_error(const std::function<void()>& fn, const std::string& expected) {
  loom::testing::expect_error<loom::UsageError>(fn, {expected});
}

void expect_workers(int nproc) { loom::testing::expect_workers("loom_tp_worker", "llama", nproc); }

}  // namespace

TEST(TensorParallel, DegreeMustSplitHeadsFfnVocabAndSequence) {
  loom::llama3::ModelArgs a = loom::llama3::flavor("debugmodel");  // 16 heads (16 kv), ffn 768, vocab 2048
  const loom::models::TensorParallelOptions sp_on{true, true};
  loom::models::validate_tp_degree(a, 4, 64, sp_on);
  expect_usage_error([&] { loom::models::validate_tp_degree(a, 3, 64, sp_on); },
                     "parallelism.tensor_parallel_degree = 3 does not divide n_heads of the model (16); "
                     "degrees that split this model: 1, 2, 4, 8");
  a.vocab_size = 2050;
  expect_usage_error([&] { loom::models::validate_tp_degree(a, 4, 64, sp_on); },
                     "does not divide the vocabulary size of the model (2050); degrees that split this model: 1, 2 "
                     "(or pad the vocabulary with model.vocab_size)");
  a.vocab_size = 2048;
  expect_usage_error([&] { loom::models::validate_tp_degree(a, 8, 60, sp_on); },
                     "does not divide training.seq_len (sequence parallel) (60)");
  loom::models::validate_tp_degree(a, 8, 60, {false, true});  // without SP the sequence is whole
}

// On one rank the plan changes nothing: same loss and gradients as the plain model.
TEST(TensorParallel, OneRankPlanIsThePlainModel) {
  loom::llama3::ModelArgs a = loom::llama3::flavor("debugmodel");
  a.n_layers = 1;
  loom::llama3::Transformer plain(a), parallel(a);
  plain.init_weights(3);
  auto plan = loom::models::apply_tp(parallel, loom::distributed::Comm::single("tp", 0), loom::llama3::tp_plan(), {});
  loom::models::init_tp_weights(parallel, *plan, 3);
  const torch::Tensor tokens = torch::randint(0, a.vocab_size, {2, 8});
  const torch::Tensor a_loss = plain.forward_loss(tokens, tokens), b_loss = parallel.forward_loss(tokens, tokens);
  EXPECT_NEAR(a_loss.item<double>(), b_loss.item<double>(), 1e-6 * a_loss.item<double>());
}

// A headwise rule names a parameter (attention sinks) and gives it Shard(0) on tp; one naming a
// module is a mistake in the plan, said in one line.
TEST(TensorParallel, HeadwiseRuleShardsANamedParameterAlongHeads) {
  loom::llama3::ModelArgs a = loom::llama3::flavor("debugmodel");
  a.n_layers = 1;
  loom::llama3::Transformer model(a);
  auto& attention = static_cast<loom::models::TransformerBlock&>(model.layer("0")).attention();
  // Llama has no sinks (the shared plan's sinks rule matches nothing there): this plan's headwise rule
  // names a parameter it has whose rows are per head, wq.weight [n_heads * head_dim, dim].
  const loom::models::TPPlan plan = {{"layers.*.attention.wq.weight", loom::models::TPStyle::kHeadwise}};
  loom::tp::TensorParallel tp(loom::distributed::Comm::single("tp", 0), false);
  loom::models::apply_tp(model, tp, plan, {false, true, false});
  ASSERT_TRUE(tp.is_sharded("layers.0.attention.wq.weight"));
  const auto layout = tp.layout_of("layers.0.attention.wq.weight", attention.wq().weight().sizes().vec());
  ASSERT_EQ(layout.placements.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<loom::tensor::Shard>(layout.placements[0].placement));
  EXPECT_EQ(std::get<loom::tensor::Shard>(layout.placements[0].placement).dim, 0);
  EXPECT_FALSE(tp.is_sharded("layers.0.attention.wk.weight"));
  loom::llama3::Transformer other(a);
  loom::tp::TensorParallel tp2(loom::distributed::Comm::single("tp", 0), false);
  loom::testing::expect_error<loom::Error>(
      [&] {
        loom::models::apply_tp(other, tp2, {{"layers.*.attention.wq", loom::models::TPStyle::kHeadwise}},
                               {false, true, false});
      },
      {"the TP plan's headwise rule 'layers.*.attention.wq' names the module 'layers.0.attention.wq'; it must name a parameter"});
}

TEST(TensorParallel, LlamaPlanMatchesTheSingleProcessModelOnTwoRanks) { expect_workers(2); }
TEST(TensorParallel, LlamaPlanMatchesTheSingleProcessModelOnFourRanks) { expect_workers(4); }
// GPT-OSS's attention (sinks Shard(0) by heads, biased projections, a sliding-window layer) under
// the TransformerBlock plan against the single-process model: loss and every gradient shard.
TEST(TensorParallel, LlamaPlanWithSinksBiasAndWindowOnTwoRanks) {
  loom::testing::expect_workers("loom_tp_worker", "attention_features", 2);
}
TEST(TensorParallel, LlamaPlanWithSinksBiasAndWindowOnFourRanks) {
  loom::testing::expect_workers("loom_tp_worker", "attention_features", 4);
}
