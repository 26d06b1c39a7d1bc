// `loom check-layouts`' parts in one process: the layout parser, the comparison and its verdicts,
// where a rank's activations sit in the step's global grid and how they are gathered back, the
// module search, and the recorder's hooks on a real decoder (with and without activation
// checkpointing). The runs themselves: test_check_layouts.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "loom/core/error.h"
#include "loom/cp/ring_attention.h"
#include "loom/layouts/activations.h"
#include "loom/layouts/compare.h"
#include "loom/layouts/layout_spec.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/model.h"
#include "loom/testing/tiny_llama.h"

namespace {

using namespace loom::layouts;

// The message of the UsageError `f` throws ("" when it throws none).
template <typename F>
std::string usage_error(F&& f) {
  try {
    f();
  } catch (const loom::UsageError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST(CheckLayoutsSpec, ParsesDegreesSettingsAndPassthrough) {
  const LayoutSpec a = parse_layout(" pp=2, tp=2 ");
  EXPECT_EQ(a.text, "pp=2, tp=2");
  EXPECT_EQ(a.pp, 2);
  EXPECT_EQ(a.tp, 2);
  EXPECT_EQ(a.dp_shard, 1);
  EXPECT_EQ(a.world_size(), 4);
  EXPECT_EQ(a.dp_degree(), 1);
  const auto o = a.overrides(4);
  // Every degree is set, so the config's own (FSDP over all ranks by default) cannot leak in.
  for (const char* want : {"--parallelism.data_parallel_replicate_degree=1", "--parallelism.data_parallel_shard_degree=1",
                           "--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=1",
                           "--parallelism.pipeline_parallel_degree=2", "--parallelism.expert_parallel_degree=1",
                           "--training.local_batch_size=4"}) {
    EXPECT_TRUE(contains(o, want)) << want;
  }

  const LayoutSpec h = parse_layout("hsdp=2,fsdp=2,async_tp=true,tp=2,pp_schedule=Interleaved1F1B,microbatch=2,ep=2,"
                                    "activation_checkpoint.mode=full");
  EXPECT_EQ(h.world_size(), 8);  // ep borrows ranks
  EXPECT_EQ(h.dp_degree(), 4);
  EXPECT_EQ(h.ep, 2);
  const auto ho = h.overrides(1);
  for (const char* want : {"--parallelism.enable_async_tensor_parallel=true",
                           "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                           "--parallelism.pipeline_parallel_microbatch_size=2", "--activation_checkpoint.mode=full",
                           "--parallelism.expert_parallel_degree=2", "--parallelism.data_parallel_replicate_degree=2"}) {
    EXPECT_TRUE(contains(ho, want)) << want;
  }
  EXPECT_EQ(parse_layout("dp=2").dp_replicate, 2);
  EXPECT_EQ(parse_layout("replicate=3").dp_replicate, 3);
}

TEST(CheckLayoutsSpec, RefusesBadLayoutsInOneLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "--layout is empty"},
      {"tp", "'tp' is not key=value"},
      {"tp=0", "tp must be a positive integer, got '0'"},
      {"tp=two", "tp must be a positive integer, got 'two'"},
      {"fsdp=2,zp=2", "unknown key 'zp'"},
      {"tp=2,tp=4", "tp given twice"},
      {"dp=2,hsdp=2", "hsdp given twice"},
      {"async_tp=maybe", "async_tp must be true or false"},
      {"parallelism.tensor_parallel_degree=2", "with its short key"},
      {"training.local_batch_size=2", "follows the reference's global batch"},
      {"tp=2,,pp=2", "an empty item"},
  };
  for (const auto& [text, want] : cases) {
    const std::string message = usage_error([&, t = text] { parse_layout(t); });
    EXPECT_NE(message.find(want), std::string::npos) << "'" << text << "': " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(CheckLayoutsSpec, KeepsTheGlobalBatch) {
  EXPECT_EQ(local_batch_for(parse_layout("fsdp=4"), 8), 2);
  EXPECT_EQ(local_batch_for(parse_layout("hsdp=2,fsdp=2,tp=2"), 8), 2);
  EXPECT_EQ(local_batch_for(parse_layout("pp=2,tp=2"), 4), 4);
  const std::string message = usage_error([] { local_batch_for(parse_layout("fsdp=8"), 4); });
  EXPECT_NE(message.find("4 rows per batch do not split over its 8 data-parallel ranks"), std::string::npos) << message;
}

TEST(CheckLayoutsSpec, RefusesOverridesItSetsItself) {
  EXPECT_NO_THROW(check_extra_overrides({"--training.seq_len=64", "--training.deterministic=true", "--training.deterministic"}));
  EXPECT_NE(usage_error([] { check_extra_overrides({"--parallelism.tensor_parallel_degree=2"}); }).find("--layout"),
            std::string::npos);
  EXPECT_NE(usage_error([] { check_extra_overrides({"--training.deterministic=false"}); }).find("deterministic = true"),
            std::string::npos);
}

TEST(CheckLayoutsCompare, RelativeDifferences) {
  EXPECT_DOUBLE_EQ(relative_difference(2.0, 2.5), 0.25);
  EXPECT_EQ(relative_difference(0.0, 0.0), 0.0);
  EXPECT_TRUE(std::isinf(relative_difference(0.0, 1.0)));
  EXPECT_TRUE(std::isnan(relative_difference(1.0, std::nan(""))));
  const torch::Tensor a = torch::tensor({3.0f, 4.0f});
  EXPECT_NEAR(relative_difference(a, torch::tensor({3.0f, 4.5f})), 0.1, 1e-12);  // 0.5 / 5
  EXPECT_TRUE(std::isinf(relative_difference(a, torch::zeros({3}))));  // another shape
  // Frobenius, not elementwise: one element off by 100 % of itself in a large tensor is small.
  torch::Tensor big = torch::ones({100});
  torch::Tensor off = big.clone();
  off[0] = 2.0f;
  EXPECT_NEAR(relative_difference(big, off), 0.1, 1e-12);
}

TEST(CheckLayoutsCompare, WorstTensorNamesTheLargestAndRefusesMissingOnes) {
  const TensorMap ref = {{"a", torch::ones({4})}, {"b", torch::ones({4})}, {"c", torch::ones({4})}};
  TensorMap got = ref;
  got["b"] = torch::full({4}, 1.5f);
  got["c"] = torch::full({4}, 1.1f);
  const WorstTensor w = worst_tensor(ref, got);
  EXPECT_EQ(w.name, "b");
  EXPECT_NEAR(w.difference, 0.5, 1e-7);
  got["c"] = torch::full({4}, std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(worst_tensor(ref, got).name, "c");  // NaN is the worst
  got.erase("a");
  EXPECT_THROW(worst_tensor(ref, got), loom::Error);
}

StepComparison comparison(double grad, double norm, double loss, double param) {
  StepComparison c;
  c.step = 1;
  c.ref = {1, 7.5, 0.86415};
  c.got = {1, 7.5 * (1 + loss), 0.86415 * (1 - norm)};
  c.gradient = {"layers.0.attention.wq.weight", grad};
  c.norm_difference = norm;
  c.loss_difference = loss;
  c.parameter = {"output.weight", param};
  return c;
}

TEST(CheckLayoutsCompare, VerdictsInOrderOfCause) {
  const double tol = 1e-5;
  EXPECT_EQ(verdict_of(comparison(1e-7, 1e-7, 1e-7, 1e-7), tol), Verdict::kMatch);
  // A gradient explains everything after it.
  EXPECT_EQ(verdict_of(comparison(1e-3, 1e-3, 1e-3, 1e-3), tol), Verdict::kGradient);
  // Every gradient equal, a wrong norm (the PP x TP bug of issue 45): the updates differ too.
  EXPECT_EQ(verdict_of(comparison(1e-7, 0.086, 1e-8, 1e-2), tol), Verdict::kNorm);
  EXPECT_EQ(verdict_of(comparison(1e-7, 1e-7, 1e-3, 1e-7), tol), Verdict::kLoss);
  EXPECT_EQ(verdict_of(comparison(1e-7, 1e-7, 1e-7, 1e-3), tol), Verdict::kParameter);
  EXPECT_EQ(verdict_of(comparison(std::nan(""), 0, 0, 0), tol), Verdict::kGradient);

  StepComparison norm = comparison(1e-7, 0.086, 1e-8, 1e-2);
  norm.verdict = verdict_of(norm, tol);
  EXPECT_NE(explain(norm, tol).find("every gradient equal, the norm differs: a reduction error"), std::string::npos)
      << explain(norm, tol);
  StepComparison grad = comparison(1e-3, 0, 0, 0);
  grad.verdict = verdict_of(grad, tol);
  EXPECT_NE(explain(grad, tol).find("layers.0.attention.wq.weight"), std::string::npos);
  EXPECT_STREQ(verdict_name(Verdict::kNorm), "norm");
}

// ---- Where a rank's activations sit, and gathering them back ----

TEST(CheckLayoutsActivations, RowsFollowTheLoaderAndTheMicroBatches) {
  ActivationGeometry g;
  g.local_batch = 4, g.dp_degree = 2, g.dp_rank = 1, g.microbatches = 2;
  EXPECT_EQ(row_start(g, 0, 2), 4);   // rank 1's rows 4..7 of each 8, micro-batch 0
  EXPECT_EQ(row_start(g, 1, 2), 6);   // micro-batch 1
  EXPECT_EQ(row_start(g, 2, 2), 12);  // the second accumulated batch
  g.microbatches = 1;
  EXPECT_EQ(row_start(g, 1, 4), 12);
}

TEST(CheckLayoutsActivations, SequencePiecesOfContextAndSequenceParallelism) {
  ActivationGeometry g;
  g.seq_len = 16;
  bool replicated = false;
  EXPECT_EQ(*sequence_segments(g, 16, replicated), (Segments{{0, 16}}));
  EXPECT_FALSE(replicated);
  EXPECT_FALSE(sequence_segments(g, 8, replicated).has_value());
  g.cp_degree = 2, g.cp_rank = 0;  // chunks 0 and 3 of 4
  EXPECT_EQ(*sequence_segments(g, 8, replicated), (Segments{{0, 4}, {12, 4}}));
  g.tp_degree = 2, g.tp_rank = 1;  // sequence parallel: the second half of that piece
  EXPECT_EQ(*sequence_segments(g, 4, replicated), (Segments{{12, 4}}));
  EXPECT_FALSE(replicated);
  EXPECT_EQ(*sequence_segments(g, 8, replicated), (Segments{{0, 4}, {12, 4}}));  // not split: the same on each tp rank
  EXPECT_TRUE(replicated);
  g.tp_degree = 4, g.tp_rank = 1;
  g.cp_rank = 1;  // chunks 1 and 2: [4, 12); tp rank 1 of 4 holds its positions [2, 4)
  EXPECT_EQ(*sequence_segments(g, 2, replicated), (Segments{{6, 2}}));
}

// A [rows, seq, dim] tensor cut as every rank of dp 2 x cp 2 x tp 2 (sequence parallel) with two
// micro-batches holds it, then gathered back: the whole tensor, bitwise.
TEST(CheckLayoutsActivations, AssembleUndoesEveryCut) {
  const int64_t rows = 8, seq = 16, dim = 3;
  const torch::Tensor whole = torch::randn({rows, seq, dim});
  std::vector<ActivationPiece> pieces;
  for (int dp = 0; dp < 2; ++dp) {
    for (int cp = 0; cp < 2; ++cp) {
      for (int tp = 0; tp < 2; ++tp) {
        ActivationGeometry g;
        g.local_batch = 4, g.microbatches = 2, g.seq_len = seq;
        g.dp_degree = 2, g.dp_rank = dp, g.cp_degree = 2, g.cp_rank = cp, g.tp_degree = 2, g.tp_rank = tp;
        const torch::Tensor local_rows = whole.narrow(0, dp * 4, 4);
        const torch::Tensor cp_piece = loom::cp::shard_sequence(local_rows, 1, cp, 2);  // [4, 8, dim]
        const torch::Tensor mine = cp_piece.narrow(1, tp * 4, 4);
        for (int64_t call = 0; call < 2; ++call) {
          bool replicated = false;
          const torch::Tensor data = mine.narrow(0, call * 2, 2);
          pieces.push_back({"layers.0", "output", 0, row_start(g, call, 2), *sequence_segments(g, 4, replicated), data});
        }
      }
    }
  }
  std::vector<std::string> incomplete;
  const StepActivations a = assemble(pieces, rows, seq, &incomplete);
  EXPECT_TRUE(incomplete.empty());
  ASSERT_EQ(a.outputs.count("layers.0"), 1u);
  EXPECT_TRUE(torch::equal(a.outputs.at("layers.0"), whole));
  // A missing piece leaves the module out, named.
  pieces.pop_back();
  const StepActivations partial = assemble(pieces, rows, seq, &incomplete);
  EXPECT_EQ(partial.outputs.count("layers.0"), 0u);
  EXPECT_EQ(incomplete, std::vector<std::string>{"layers.0"});
}

TEST(CheckLayoutsActivations, RecordedModules) {
  for (const char* yes : {"tok_embeddings", "norm", "layers.3", "layers.3.attention", "layers.3.feed_forward", "layers.3.moe"}) {
    EXPECT_TRUE(recorded_module(yes)) << yes;
  }
  for (const char* no : {"", "layers", "output", "layers.3.attention_norm", "layers.3.ffn_norm", "layers.3.attention.wq"}) {
    EXPECT_FALSE(recorded_module(no)) << no;
  }
}

StepActivations activations(std::vector<std::string> order, double scale_at_output = 1, const std::string& bad_output = "",
                            const std::string& bad_grad = "") {
  StepActivations a;
  a.order = order;
  for (const auto& m : order) {
    a.outputs[m] = torch::ones({2, 4, 3}) * (m == bad_output ? scale_at_output : 1.0);
    a.grads[m] = torch::ones({2, 4, 3}) * (m == bad_grad ? 2.0 : 1.0);
  }
  return a;
}

TEST(CheckLayoutsActivations, FirstDifferingModule) {
  const std::vector<std::string> order = {"tok_embeddings", "layers.0.attention", "layers.0.feed_forward", "layers.0",
                                          "layers.1.attention", "layers.1.feed_forward", "layers.1", "norm"};
  const StepActivations ref = activations(order);
  EXPECT_FALSE(first_differing_module(ref, activations(order), 1e-5).has_value());
  // The forward: the first output that differs, even if later gradients differ too.
  const auto fwd = first_differing_module(ref, activations(order, 1.5, "layers.1.attention", "layers.0"), 1e-5);
  ASSERT_TRUE(fwd.has_value());
  EXPECT_EQ(fwd->module, "layers.1.attention");
  EXPECT_EQ(fwd->what, "output");
  EXPECT_NEAR(fwd->difference, 0.5, 1e-12);
  // The backward: the gradient at layers.0's output differs while layers.1.attention's output
  // gradient agrees: layers.1.attention's backward made it.
  const auto bwd = first_differing_module(ref, activations(order, 1, "", "layers.0"), 1e-5);
  ASSERT_TRUE(bwd.has_value());
  EXPECT_EQ(bwd->module, "layers.1.attention");
  EXPECT_EQ(bwd->what, "input gradient");
  EXPECT_EQ(bwd->at, "layers.0's output gradient");
  // At the final norm's output: the head and loss.
  EXPECT_EQ(first_differing_module(ref, activations(order, 1, "", "norm"), 1e-5)->module, "output");
}

// The recorder on the tiny Llama, one process: the modules in forward order, the residual
// stream's identities (a block's output is its input plus its attention and feed-forward outputs;
// the gradient at the feed-forward's output is the block's), and the same records with every
// block checkpointed (the first, no-grad pass is not recorded, the recompute is).
StepActivations record_tiny_llama(bool checkpointed) {
  torch::manual_seed(0);
  loom::llama3::ModelArgs args = loom::testing::tiny_llama_args();
  auto model = std::make_shared<loom::llama3::Transformer>(args);
  model->init_weights(3);
  if (checkpointed) loom::models::apply_ac(*model, loom::ac::ACOptions::from({loom::ac::Mode::kFull, ""}));
  ActivationGeometry g;
  g.local_batch = 2, g.seq_len = 16;
  ActivationRecorder recorder({model}, g);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const torch::Tensor tokens = torch::randint(0, 128, {2, 16}, gen);
  {
    torch::NoGradGuard no_grad;  // not recorded (validation)
    model->forward_loss(tokens, tokens);
  }
  model->forward_loss(tokens, tokens).backward();
  recorder.remove_hooks();
  std::vector<std::string> incomplete;
  StepActivations a = assemble(recorder.pieces(), 2, 16, &incomplete);
  EXPECT_TRUE(incomplete.empty());
  EXPECT_TRUE(recorder.unplaced().empty());
  return a;
}

TEST(CheckLayoutsActivations, RecorderOnADecoder) {
  const StepActivations a = record_tiny_llama(false);
  EXPECT_EQ(a.order, (std::vector<std::string>{"tok_embeddings", "layers.0.attention", "layers.0.feed_forward", "layers.0",
                                               "layers.1.attention", "layers.1.feed_forward", "layers.1", "norm"}));
  EXPECT_TRUE(torch::allclose(a.outputs.at("layers.0"),
                              a.outputs.at("tok_embeddings") + a.outputs.at("layers.0.attention") +
                                  a.outputs.at("layers.0.feed_forward"),
                              1e-5, 1e-6));
  EXPECT_TRUE(torch::equal(a.grads.at("layers.1.feed_forward"), a.grads.at("layers.1")));
  EXPECT_GT(a.grads.at("tok_embeddings").abs().sum().item<double>(), 0);

  const StepActivations c = record_tiny_llama(true);
  EXPECT_EQ(c.order, a.order);
  for (const auto& m : a.order) {
    EXPECT_TRUE(torch::equal(c.outputs.at(m), a.outputs.at(m))) << m;
    EXPECT_TRUE(torch::equal(c.grads.at(m), a.grads.at(m))) << m;
  }
}

}  // namespace
