// The memory model's exact parts (parameters and optimizer state against the model's own counts,
// FSDP shards against the planner) and its directions (AC, TP, PP). Its accuracy against measured
// runs is bench/plan_memory.py's (8 CPU layouts, +-10 %).
#include <gtest/gtest.h>

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdio>

#include "loom/models/spec.h"
#include "loom/plan/memory_model.h"
#include "loom/plan/search.h"
#include "loom/train/config.h"

namespace plan_memory_test {

struct ModelSetup {
  loom::train::JobConfig config;
  const loom::models::ModelSpec* spec;
  std::unique_ptr<loom::models::ModelArgs> args;
  loom::plan::ModelShape shape;
};

ModelSetup make_setup(const std::string& flavor, const std::string& extra = "") {
  ModelSetup s;
  s.config = loom::train::parse_config_toml(
      c10::str("[model]\nname = \"llama3\"\nflavor = \"", flavor, "\"\nvocab_size = 2048\n[training]\nseq_len = 256\n",
               "local_batch_size = 8\n[validation]\nenable = false\n", extra),
      "test");
  s.spec = &loom::models::get_spec("llama3");
  s.args = s.spec->build_args({flavor, 2048, 256, 0});
  s.shape = loom::plan::ModelShape::of(*s.spec, *s.args);
  return s;
}

loom::plan::MemoryEstimate estimate(ModelSetup& s, loom::plan::Layout layout) {
  layout.local_batch_size = s.config.training.local_batch_size;
  loom::train::JobConfig c = s.config;
  layout.apply_to(c);
  return loom::plan::estimate_memory(s.shape, *s.args, c, layout);
}

TEST(PlanMemory, OneDeviceHoldsEveryParameterAndTwoAdamWMoments) {
  ModelSetup s = make_setup("debugmodel");
  const int64_t total = s.spec->count_parameters(*s.args).total;
  const auto m = estimate(s, {});
  EXPECT_EQ(m.parameters, 4 * total);
  EXPECT_EQ(m.optimizer_state, 8 * total);
  EXPECT_EQ(m.buffers_in_flight, 0);
  EXPECT_GT(m.activations, 0);
  EXPECT_EQ(m.peak, m.parameters + m.gradients + m.optimizer_state + m.activations + m.buffers_in_flight);
}

TEST(PlanMemory, FsdpShardsEveryGroupWithThePlannersPaddingAndKeepsWhatItGathers) {
  ModelSetup s = make_setup("debugmodel");
  const int64_t total = s.spec->count_parameters(*s.args).total;
  loom::plan::Layout fsdp;
  fsdp.dp_shard = 4;
  const auto m = estimate(s, fsdp);
  // A quarter of every group, rounded up to the planner's 16-byte shards: at most a few elements
  // per group more than a quarter of the whole.
  const int64_t groups = static_cast<int64_t>(s.shape.groups.size());
  EXPECT_GE(m.parameters, 4 * ((total + 3) / 4));
  EXPECT_LE(m.parameters, 4 * (total / 4 + 4 * groups));
  EXPECT_EQ(m.gradients, m.parameters);  // sharded fp32 gradients persist
  EXPECT_EQ(m.optimizer_state, 2 * m.parameters);
  EXPECT_GT(m.buffers_in_flight, 0);     // gathered groups and a gradient being reduced
  // Not resharded after forward: every group's fp32 gathered copy (the whole model) plus one
  // gradient being reduced; nothing else changes.
  fsdp.reshard_after_forward = "never";
  const auto kept = estimate(s, fsdp);
  EXPECT_GE(kept.buffers_in_flight, 4 * total);
  EXPECT_GT(kept.buffers_in_flight, m.buffers_in_flight);
  EXPECT_EQ(kept.parameters, m.parameters);
  EXPECT_EQ(kept.activations, m.activations);
}

TEST(PlanMemory, CheckpointingTensorAndPipelineParallelismCutWhatTheyShould) {
  ModelSetup s = make_setup("debugmodel");
  const auto none = estimate(s, {});
  ModelSetup full_s = make_setup("debugmodel", "[activation_checkpoint]\nmode = \"full\"\n");
  ModelSetup every2 = make_setup("debugmodel", "[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"2\"\n");
  const auto full = estimate(full_s, {});
  const auto selective = estimate(every2, {});
  EXPECT_LT(full.activations, selective.activations);
  EXPECT_LT(selective.activations, none.activations);
  loom::plan::Layout tp;
  tp.tp = 2;
  const auto tp2 = estimate(s, tp);
  EXPECT_LT(tp2.parameters, none.parameters);
  EXPECT_LT(tp2.activations, none.activations);
  loom::plan::Layout pp;
  pp.pp = 2;
  pp.schedule = "1F1B";
  pp.microbatch_size = 2;
  const auto pp2 = estimate(s, pp);
  ASSERT_EQ(pp2.rank_peaks.size(), 2u);
  EXPECT_LT(pp2.parameters, none.parameters);
  EXPECT_EQ(pp2.peak, std::max(pp2.rank_peaks[0], pp2.rank_peaks[1]));
}

TEST(PlanMemory, TorchTitansLlama405BLayoutFitsAnH100) {
  // FSDP 8 x TP 8 x PP 8 (Interleaved1F1B), seq 8192, local batch 2 in micro-batches of 1, bf16
  // FSDP gathers, full AC: TorchTitan trains it on 80 GB H100s, so the model must put it under 80 GiB.
  loom::train::JobConfig config = loom::train::parse_config_toml(
      "[model]\nname = \"llama3\"\nflavor = \"405B\"\nvocab_size = 128256\n[training]\nseq_len = 8192\n"
      "local_batch_size = 2\nmixed_precision_param = \"bfloat16\"\n[validation]\nenable = false\n"
      "[activation_checkpoint]\nmode = \"full\"\n",
      "test");
  const auto& spec = loom::models::get_spec("llama3");
  const auto args = spec.build_args({"405B", 128256, 8192, 0});
  const auto shape = loom::plan::ModelShape::of(spec, *args);
  loom::plan::Layout layout;
  layout.dp_shard = 8;
  layout.tp = 8;
  layout.pp = 8;
  layout.schedule = "Interleaved1F1B";
  layout.microbatch_size = 1;
  layout.local_batch_size = 2;
  layout.apply_to(config);
  const auto m = loom::plan::estimate_memory(shape, *args, config, layout);
  std::printf("405B, FSDP 8 x TP 8 x PP 8: %s\n", m.describe().c_str());
  EXPECT_LT(static_cast<double>(m.peak), 80.0 * (1 << 30));
  EXPECT_GT(static_cast<double>(m.peak), 10.0 * (1 << 30));  // 405B / 512 ranks of fp32 state alone is ~9.5 GiB
}

TEST(PlanMemory, MixtureOfExpertsBlocksCountTheirRoutedRows) {
  // The debug Qwen3-MoE: the shape reads every MoE block's routing from its MoE module, and a block's activations follow the routed formula of memory_model.h: doubling the
  // experts each token visits adds k more rows of c dim + 3 c h + 4 dim + 4 per token and MoE layer
  // (MoE::forward's saved tensors: the permuted input, gate / up / SwiGLU output, the fp32 expert
  // output and the routing weight the weighting product keeps).
  auto setup = [](int64_t top_k) {
    ModelSetup s;
    s.config = loom::train::parse_config_toml(
        c10::str("[model]\nname = \"qwen3_moe\"\nflavor = \"debugmodel\"\nvocab_size = 2048\n[training]\n"
                 "seq_len = 256\nlocal_batch_size = 8\n[validation]\nenable = false\n"),
        "test");
    s.spec = &loom::models::get_spec("qwen3_moe");
    s.args = s.spec->build_args({"debugmodel", 2048, 256, 0});
    s.shape = loom::plan::ModelShape::of(*s.spec, *s.args);
    for (auto& g : s.shape.groups) {
      if (g.moe.experts > 0) g.moe.top_k = top_k;
    }
    return s;
  };
  ModelSetup k2 = setup(2);
  int64_t moe_layers = 0, hidden = 0, dim = k2.shape.dim;
  for (const auto& g : k2.shape.groups) {
    const bool has_experts = std::any_of(g.tensors.begin(), g.tensors.end(), [](const auto& t) { return t.expert; });
    EXPECT_EQ(g.moe.experts > 0, has_experts) << g.name << ": a block with routed experts is an MoE block";
    if (g.moe.experts == 0) continue;
    ++moe_layers;
    EXPECT_EQ(g.moe.top_k, 2) << g.name;
    EXPECT_EQ(g.moe.experts, 8) << g.name;
    EXPECT_GT(g.moe.hidden, 0) << g.name;
    hidden = g.moe.hidden;
  }
  EXPECT_GT(moe_layers, 0);
  ModelSetup k4 = setup(4);
  const auto two = estimate(k2, {});
  const auto four = estimate(k4, {});
  const int64_t tokens = 8 * 256, c = 4;
  EXPECT_EQ(four.activations - two.activations, moe_layers * tokens * 2 * (c * dim + 3 * c * hidden + 4 * dim + 4));
  EXPECT_EQ(four.parameters, two.parameters);
  // Expert parallelism splits the experts' weights, not the rows a rank computes.
  loom::plan::Layout ep;
  ep.dp_shard = 2;
  ep.ep = 2;
  const auto ep2 = estimate(k2, ep);
  loom::plan::Layout fsdp;
  fsdp.dp_shard = 2;
  const auto fsdp2 = estimate(k2, fsdp);
  EXPECT_EQ(ep2.activations, fsdp2.activations);
}

}  // namespace plan_memory_test
