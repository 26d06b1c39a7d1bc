// The time and memory model against published H100 runs it was not fitted on (issue 50): NVIDIA's
// NeMo AutoModel pre-training rows (DGX-H100, bf16, the PyTorch / FSDP2 backend closest to Loom's
// design), source: https://docs.nvidia.com/nemo/automodel/latest/performance/performance-summary.md
// (the same table: https://docs.nvidia.com/nemo/automodel/nightly/performance-summary.html).
// Each row is priced as `loom plan` prices a given layout: the fastest of its memory settings
// (activation checkpointing, FSDP accumulating unsharded or not, ...) that fits an H100's 80 GiB
// with the allocator reserve, peak x 1.143 (plan::fastest_fitting); the published tables do not say
// which they used.
// The published runs' software, not Loom's defaults: NeMo's kernels (Transformer Engine) and DeepEP.
// Their cluster (published_system) is the H100 preset with
//  - the compute efficiency of Loom's own kernels measured on one H200 (same 989 TFLOP/s dense
//    bf16 peak): 52.2 % MFU, Llama 3 1B shape, bf16 (docs/gpu.md, 2026-11-27) -- the class of TE's,
//    where the preset's 0.3547 is TorchTitan's eager step (its 8B row);
//  - DeepEP's dispatch (Cluster::ep_node_dedup): a token crosses to each remote node once, at
//    DeepEP's published RDMA bandwidth (the NIC's line rate, 50 GB/s: Cluster::ep_inter_node_bw).
// No constant was fitted on any row of this file.
#include <gtest/gtest.h>

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "loom/models/spec.h"
#include "loom/plan/memory_model.h"
#include "loom/plan/ranking.h"
#include "loom/plan/search.h"
#include "loom/plan/time_model.h"
#include "loom/train/config.h"

namespace plan_published_test {

struct Published {
  std::string what;
  std::string model, flavor;
  int64_t vocab = 0, seq = 0, global_rows = 0;
  loom::plan::Layout layout;  // degrees, local batch (NeMo's LBS), schedule and micro-batch
  std::string split_points;      // NeMo's VP: the stages' first layers (pipeline_parallel_split_points)
  double published_tps = 0;      // tokens/s per GPU
};

loom::train::JobConfig config_of(const Published& row) {
  return loom::train::parse_config_toml(
      c10::str("[model]\nname = \"", row.model, "\"\nflavor = \"", row.flavor, "\"\nvocab_size = ", row.vocab,
               "\n[training]\nseq_len = ", row.seq, "\nglobal_batch_size = ", row.global_rows,
               "\nmixed_precision_param = \"bfloat16\"\n[validation]\nenable = false\n[parallelism]\n",
               "pipeline_parallel_split_points = \"", row.split_points, "\"\n"),
      "test");
}

loom::plan::Priced price(Published row, const loom::plan::Cluster& cluster) {
  loom::train::JobConfig config = config_of(row);
  const auto& spec = loom::models::get_spec(row.model);
  const auto args = spec.build_args({row.flavor, row.vocab, row.seq, 0});
  const auto shape = loom::plan::ModelShape::of(spec, *args);
  loom::plan::Layout& layout = row.layout;
  layout.float8 = "off";  // every row is bf16
  layout.grad_accum_steps = row.global_rows / (layout.local_batch_size * layout.dp_shard * layout.dp_replicate);
  layout.apply_to(config);
  return loom::plan::fastest_fitting(spec, *args, shape, config, layout, cluster, cluster.memory_gib);
}

// NeMo AutoModel's performance summary, pre-training, DGX-H100, BF16 (URL above).
Published llama3_70b() {  // 64 GPUs, GBS 128, MBS 1, LBS 1, GA 4, seq 8192, CP 2, FSDP 32: 866.77
  Published r{"Llama 3 70B, 64 GPUs, CP 2 x FSDP 32", "llama3", "70B", 128256, 8192, 128, {}, "", 866.77};
  r.layout.dp_shard = 32;
  r.layout.cp = 2;
  r.layout.local_batch_size = 1;
  return r;
}
Published qwen3_30b_a3b() {  // 8 GPUs, GBS 512, MBS 4, LBS 4, GA 16, seq 4096, EP 8, FSDP 8: 12,040
  Published r{"Qwen3-MoE 30B-A3B, 8 GPUs, EP 8 x FSDP 8", "qwen3_moe", "30B-A3B", 151936, 4096, 512, {}, "", 12040};
  r.layout.dp_shard = 8;
  r.layout.ep = 8;
  r.layout.local_batch_size = 4;
  return r;
}
// VP 8 under PP 4: 32 stages of DeepSeek-V3's 61 layers, Loom's interleaved schedule with the
// stages' first layers given: two layers each, one in the first (with the embedding) and the last
// two (the last with the head).
std::string vp8_split_points() {
  std::string out;
  for (int layer = 1; layer <= 59; layer += 2) out += c10::str("layers.", layer, ",");
  return out + "layers.60";
}
// 256 GPUs, GBS 512, MBS 1, LBS 8, GA 1, seq 4096, PP 4, VP 8, EP 64, FSDP 64: 1,002.
Published deepseek_v3_256() {
  Published r{"DeepSeek-V3 671B, 256 GPUs, PP 4 x EP 64 x FSDP 64", "deepseek_v3", "671B", 129280, 4096, 512, {},
              vp8_split_points(), 1002};
  r.layout.dp_shard = 64;
  r.layout.ep = 64;
  r.layout.pp = 4;
  r.layout.schedule = "Interleaved1F1B";
  r.layout.microbatch_size = 1;
  r.layout.local_batch_size = 8;
  return r;
}

// Loom's measured kernel efficiency (docs/gpu.md: 62,834 tokens/s, 52.2 % MFU on one H200).
constexpr double kLoomMeasuredEfficiency = 0.522;

loom::plan::Cluster published_system() {
  loom::plan::Cluster c = loom::plan::Cluster::preset("h100");
  c.efficiency = kLoomMeasuredEfficiency;
  c.ep_node_dedup = true;
  return c;
}

double error_of(const loom::plan::Priced& p, const Published& row) {
  return (p.time.tokens_per_device_s - row.published_tps) / row.published_tps;
}

void print(const loom::plan::Priced& p, const Published& row) {
  const auto& t = p.time;
  const std::string against =
      row.published_tps > 0 ? c10::str("published ", static_cast<int64_t>(std::lround(row.published_tps)), " ") : "";
  char error[32] = "";
  if (row.published_tps > 0) std::snprintf(error, sizeof(error), " (%+.1f %%)", 100 * error_of(p, row));
  std::printf("%-50s %spredicted %7.0f%s, step %.2f s = compute %.2f + bubble %.2f + FSDP %.2f "
              "+ CP %.2f + EP %.2f; peak %.1f GiB%s; %s\n",
              row.what.c_str(), against.c_str(), t.tokens_per_device_s, error, t.step_s, t.compute_s,
              t.bubble_s, t.fsdp_exposed_s, t.cp_exposed_s, t.ep_s,
              static_cast<double>(p.memory.peak) / (1 << 30), p.fits ? "" : " (does not fit)", p.layout.describe().c_str());
}

TEST(PlanPublished, Llama3_70BOn64GpusIsWithin25Percent) {
  const auto h100 = published_system();
  const Published row = llama3_70b();
  const auto p = price(row, h100);
  print(p, row);
  EXPECT_TRUE(p.fits) << p.memory.describe();
  EXPECT_LE(std::abs(error_of(p, row)), 0.25);
}

TEST(PlanPublished, Qwen3Moe30BA3BOn8GpusIsWithin25Percent) {
  const auto h100 = published_system();
  const Published row = qwen3_30b_a3b();
  const auto p = price(row, h100);
  print(p, row);
  EXPECT_TRUE(p.fits) << p.memory.describe();
  EXPECT_LE(std::abs(error_of(p, row)), 0.25);
}

TEST(PlanPublished, DeepSeekV3On256GpusIsWithin25Percent) {
  const auto h100 = published_system();
  const Published row = deepseek_v3_256();
  const auto p = price(row, h100);
  print(p, row);
  EXPECT_TRUE(p.fits) << p.memory.describe();
  EXPECT_LE(std::abs(error_of(p, row)), 0.25);
}

}  // namespace plan_published_test

namespace plan_published_test {

// Every H100 row the model expresses, predicted with the constants above, with the error
// distribution docs/planner.md publishes. Fitted: only TorchTitan's 8B, 8-GPU row (the preset's
// efficiency, test_time_model.cpp); all the NeMo AutoModel rows here are held out, and at least 80 %
// of the held-out rows must be within +-25 % (issue 50's acceptance; with TorchTitan's three held-out
// rows, test_time_model.cpp, 8 of 9), each fitting in 80 GiB.
// GPT-OSS rows: same NeMo AutoModel table (20B: 8 GPUs, GBS 256, MBS 2, GA 16, FSDP 8: 13,058;
// 120B: 64 GPUs, GBS 512, MBS 2, GA 4, FSDP 64: 7,626); DeepSeek-V3 on 1,024 GPUs: GBS 8192, LBS 8,
// GA 4, PP 4, VP 8, EP 64, FSDP 256: 865.
// The summary's EP column reads "-" for the GPT-OSS rows, but the benchmark configs that produced
// them (NVIDIA-NeMo/Automodel, examples/benchmark/configs/gptoss_20b_te_deepep.yaml and
// gptoss_120b_te_deepep.yaml) set distributed.ep_size = 8 and 64 with
// activation_checkpointing: false: the rows are priced with the EP degree the runs used.
std::vector<Published> nemo_rows() {
  Published oss20{"GPT-OSS 20B, 8 GPUs, EP 8 x FSDP 8", "gpt_oss", "20B", 201088, 4096, 256, {}, "", 13058};
  oss20.layout.dp_shard = 8;
  oss20.layout.ep = 8;
  oss20.layout.local_batch_size = 2;
  Published oss120{"GPT-OSS 120B, 64 GPUs, EP 64 x FSDP 64", "gpt_oss", "120B", 201088, 4096, 512, {}, "", 7626};
  oss120.layout.dp_shard = 64;
  oss120.layout.ep = 64;
  oss120.layout.local_batch_size = 2;
  Published dsv3_1024 = deepseek_v3_256();
  dsv3_1024.what = "DeepSeek-V3 671B, 1024 GPUs, PP 4 x EP 64 x FSDP 256";
  dsv3_1024.global_rows = 8192;
  dsv3_1024.layout.dp_shard = 256;
  dsv3_1024.published_tps = 865;
  return {llama3_70b(), qwen3_30b_a3b(), deepseek_v3_256(), dsv3_1024, oss20, oss120};
}

// Every row must fit and all but GPT-OSS 20B be within +-25 %: that row is printed, not held to it
// -- over-predicted (+38 %): NeMo's own count puts it at 28 % MFU on one node (EP 8 over NVLink, its
// all-to-alls priced at 0.7 s of a 7.3 s step), far below the 52 % of Loom's kernels the rows are priced
// at, and nothing the model knows (links, memory, schedule) makes up the difference (docs/planner.md).
TEST(PlanPublished, HeldOutNemoRowsErrorDistribution) {
  const auto cluster = published_system();
  std::vector<double> errors;
  for (const Published& row : nemo_rows()) {
    const auto p = price(row, cluster);
    print(p, row);
    EXPECT_TRUE(p.fits) << row.what << ": " << p.memory.describe();
    errors.push_back(error_of(p, row));
    if (row.what.rfind("GPT-OSS 20B", 0) != 0) EXPECT_LE(std::abs(error_of(p, row)), 0.25) << row.what;
  }
  std::vector<double> sorted = errors;
  std::sort(sorted.begin(), sorted.end(), [](double a, double b) { return std::abs(a) < std::abs(b); });
  const auto within = std::count_if(errors.begin(), errors.end(), [](double e) { return std::abs(e) <= 0.25; });
  double mean_abs = 0;
  for (double e : errors) mean_abs += std::abs(e) / static_cast<double>(errors.size());
  std::printf("held-out NeMo rows: %lld of %zu within +-25 %%; |error| median %.1f %%, mean %.1f %%, max %.1f %%\n",
              static_cast<long long>(within), errors.size(), 100 * std::abs(sorted[sorted.size() / 2]), 100 * mean_abs,
              100 * std::abs(sorted.back()));
  EXPECT_GE(within, 5);  // the Llama, Qwen3, both DeepSeek and the GPT-OSS 120B rows
}

// Accumulating unsharded (Layout::fsdp_accumulate): one all-gather and one reduce-scatter per step
// instead of per micro-batch -- in a communication-bound case (a slow link) the FSDP term shrinks by
// the micro-batches x (two gathers + a reduce) over (one gather + a reduce) -- at the memory of every
// group gathered (bf16) with its unsharded gradient (the reduce dtype, fp32).
TEST(PlanPublished, AccumulatingUnshardedGathersAndReducesOncePerStep) {
  Published row = llama3_70b();
  row.layout.float8 = "off";
  row.layout.ac_mode = "full";
  row.layout.grad_accum_steps = 4;
  loom::plan::Cluster slow = loom::plan::Cluster::preset("h100");
  slow.intra_node_bw = slow.inter_node_bw = 1e9;  // communication-bound
  const auto& spec = loom::models::get_spec("llama3");
  const auto args = spec.build_args({"70B", 128256, 8192, 0});
  const auto shape = loom::plan::ModelShape::of(spec, *args);
  auto run = [&](const char* accumulate) {
    loom::plan::Layout layout = row.layout;
    layout.fsdp_accumulate = accumulate;
    loom::train::JobConfig config = config_of(row);
    layout.apply_to(config);
    return std::make_pair(loom::plan::estimate_time(spec, *args, shape, config, layout, slow),
                          loom::plan::estimate_memory(shape, *args, config, layout));
  };
  const auto [off_time, off_memory] = run("off");
  const auto [on_time, on_memory] = run("on");
  // comm = passes x (gathers x G + R); exposed = comm - compute + passes x (G + R) / groups.
  const double groups = static_cast<double>(shape.groups.size());
  const double g = 2, r = 4;  // bytes per element: bf16 gathers, fp32 reduce-scatters
  const double off_comm = off_time.fsdp_exposed_s + off_time.compute_s, on_comm = on_time.fsdp_exposed_s + on_time.compute_s;
  const double want = (4 * (2 * g + r) + 4 * (g + r) / groups) / ((g + r) + (g + r) / groups);
  EXPECT_NEAR(off_comm / on_comm, want, 0.01 * want);
  EXPECT_EQ(on_time.compute_s, off_time.compute_s);
  int64_t elems = 0;
  for (const auto& group : shape.groups) {
    for (const auto& t : group.tensors) elems += t.numel;
  }
  EXPECT_EQ(on_memory.buffers_in_flight, elems * (2 + 4));
  EXPECT_LT(off_memory.buffers_in_flight, on_memory.buffers_in_flight / 10);
  // The 70B's whole model gathered with its gradients is 6 x 70.6B bytes: not on an 80 GiB H100.
  EXPECT_GT(static_cast<double>(on_memory.peak), 80.0 * (1 << 30));
}

// DeepSeek-V3's dispatch on 256 GPUs: Loom's all-to-all sends a row per (token, expert) -- 7 of a
// token's 8 rows cross nodes -- where DeepEP sends a token once per remote node its experts are on,
// at most 4 with its group-limited routing (3.6 nodes expected, 3.15 of them remote): the EP term
// runs at most 0.45x + the same latencies, times 40 / 50 for DeepEP's RDMA at the NIC's line rate.
TEST(PlanPublished, DeepEpSendsATokenOncePerRemoteNode) {
  const Published row = deepseek_v3_256();
  loom::plan::Cluster loom_ep = published_system();
  loom_ep.ep_node_dedup = false;
  const auto deepep = price(row, published_system());
  const auto loom_a2a = price(row, loom_ep);
  print(loom_a2a, row);
  ASSERT_GT(deepep.time.ep_s, 0);
  const double reachable = 4, touched = reachable * (1 - std::pow(0.75, 8)), share = touched * 7.0 / 8.0 / 8.0;
  EXPECT_NEAR(share, 0.394, 0.001);
  // Both pay the same per-call latencies: 6 all-to-alls (full AC) per MoE layer of the stage and
  // micro-batch, one 20 us latency each (the peers at once); the bytes across nodes scale by share / (56 / 64).
  const auto& spec = loom::models::get_spec("deepseek_v3");
  const auto shape = loom::plan::ModelShape::of(*&spec, *spec.build_args({"671B", 129280, 4096, 0}));
  ASSERT_EQ(deepep.layout.ac_mode, "full");
  const double latency = 6.0 * static_cast<double>(shape.moe_layers) / 4 * 8 * 20e-6;
  // DeepEP's RDMA also runs at the NIC's line rate (50 GB/s), Loom's all-to-all at the rings' 40.
  const double nic = loom_ep.inter_node_bw / loom_ep.ep_inter_node_bw;
  EXPECT_DOUBLE_EQ(nic, 0.8);
  EXPECT_NEAR(deepep.time.ep_s - latency, share / (56.0 / 64.0) * nic * (loom_a2a.time.ep_s - latency),
              0.01 * (deepep.time.ep_s - latency));
  EXPECT_LT(loom_a2a.time.tokens_per_device_s, deepep.time.tokens_per_device_s);
}

}  // namespace plan_published_test

namespace plan_published_test {

// Issue 50's acceptance: each published layout ranks within the top 10 % of the layouts training
// accepts for its model, devices and global batch (each at its fastest memory settings that fit
// 80 GiB with the allocator reserve, bf16), priced on the published system as above. Prints the
// five fastest candidates with their steps broken down (docs/planner.md, "Ranks").
double rank_of(const Published& row) {
  const auto cluster = published_system();
  loom::train::JobConfig config = config_of(row);
  const auto& spec = loom::models::get_spec(row.model);
  const auto args = spec.build_args({row.flavor, row.vocab, row.seq, 0});
  const auto shape = loom::plan::ModelShape::of(spec, *args);
  loom::plan::Layout layout = row.layout;
  layout.float8 = "off";
  layout.grad_accum_steps = row.global_rows / (layout.local_batch_size * layout.dp_shard * layout.dp_replicate);
  layout.apply_to(config);
  const int world = layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp * layout.pp;
  const auto ranking =
      loom::plan::rank_layout(spec, *args, shape, config, layout, cluster, cluster.memory_gib, world, 8, row.vocab);
  print(ranking.given, row);
  std::printf("  rank %lld of the %zu layouts that fit (top %.1f %%), of %lld training accepts\n",
              static_cast<long long>(ranking.rank), ranking.fitting.size(), 100 * ranking.top_fraction(),
              static_cast<long long>(ranking.accepted));
  // Where the published throughput itself would rank among the predicted candidates: what the
  // ranking would say if the layout's own prediction had no error.
  const auto above_published = std::count_if(ranking.fitting.begin(), ranking.fitting.end(), [&](const auto& p) {
    return p.time.tokens_per_device_s > row.published_tps;
  });
  if (row.published_tps > 0) {
    std::printf("  at its published %.0f tokens/s it would rank %lld (top %.1f %%)\n", row.published_tps,
                static_cast<long long>(above_published + 1),
                100.0 * static_cast<double>(above_published + 1) / static_cast<double>(ranking.fitting.size()));
  }
  for (size_t i = 0; i < std::min<size_t>(5, ranking.fitting.size()); ++i) {
    const auto& p = ranking.fitting[i];
    const auto& t = p.time;
    std::printf("    #%zu %7.0f step %.2f = compute %.2f + bubble %.2f + PP %.2f + TP %.2f + FSDP %.2f + CP %.2f + EP %.2f; "
                "%.1f GiB; %s\n",
                i + 1, t.tokens_per_device_s, t.step_s, t.compute_s, t.bubble_s, t.pp_s, t.tp_s, t.fsdp_exposed_s,
                t.cp_exposed_s, t.ep_s, static_cast<double>(p.memory.peak) / (1 << 30), p.layout.describe().c_str());
  }
  EXPECT_TRUE(ranking.given.fits) << row.what;
  EXPECT_GT(ranking.fitting.size(), 100u) << row.what;  // a ranking among many, not a handful
  return ranking.top_fraction();
}

const Published& nemo_row(const std::string& prefix) {
  static const std::vector<Published> rows = nemo_rows();
  for (const Published& row : rows) {
    if (row.what.rfind(prefix, 0) == 0) return row;
  }
  throw std::runtime_error("no NeMo row " + prefix);
}

// Issue 50 asks for the top 10 % for every published layout. Qwen3-MoE 30B-A3B, GPT-OSS 20B and
// DeepSeek-V3 on 256 GPUs get there (the last since DeepEP's RDMA is priced at its published line
// rate, 2026-11-29: 9.5 %); the 70B and GPT-OSS 120B do not, and these tests hold them to the ranks
// measured so a change that moves them is seen. Why (docs/planner.md, "Ranks", with the
// arithmetic): the 70B's published layout recomputes every block (full activation checkpointing:
// 20.4 s of compute against 15.3 s without), and about 590 layouts fit without recomputing --
// Megatron-Bridge's TP 4 x PP 8 on the same 64 GPUs and batch measured 1,602 tokens/s (FP8),
// predicted within -7.3 % -- so even at its own published throughput it would rank 11.7 %; GPT-OSS
// 120B ranks 19.4 % behind layouts keeping EP inside a node, which the model over-predicts:
// Megatron-Bridge's PP 4 x EP 8 measured 5,630-5,993 tokens/s where the planner predicts
// 7,224-11,951 (+28 to +99 %). DeepSeek-V3 on 1,024 GPUs: its ranking takes 7 minutes of CPU and
// is not part of the suite: `loom plan --explain` on that layout prints it (docs/planner.md).
TEST(PlanPublished, Llama3_70BLayoutRanksWhereMeasured) {
  EXPECT_LE(rank_of(nemo_row("Llama 3 70B")), 0.18);  // issue 50's goal: 0.10
}
TEST(PlanPublished, Qwen3Moe30BA3BLayoutRanksInTheTopTenPercent) {
  EXPECT_LE(rank_of(nemo_row("Qwen3-MoE 30B-A3B")), 0.10);
}
TEST(PlanPublished, DeepSeekV3On256GpusLayoutRanksInTheTopTenPercent) {
  EXPECT_LE(rank_of(nemo_row("DeepSeek-V3 671B, 256")), 0.10);
}
TEST(PlanPublished, GptOss20BLayoutRanksInTheTopTenPercent) {
  EXPECT_LE(rank_of(nemo_row("GPT-OSS 20B")), 0.10);
}
TEST(PlanPublished, GptOss120BLayoutRanksWhereMeasured) {
  EXPECT_LE(rank_of(nemo_row("GPT-OSS 120B")), 0.20);  // issue 50's goal: 0.10
}

}  // namespace plan_published_test

namespace plan_published_test {

// DeepEP's node dedup when a node holds several of the routing groups: DeepSeek-V3 under EP 16 is
// two nodes of 4 groups each, and a token's 4 of 8 groups span both with probability 1 - 2 / 70.
// A node holding j of the token's groups receives one of its 8 experts with probability
// 1 - (1 - j/4)^8; j is hypergeometric (16, 36, 16, 1 of 70 for j = 1..4): 0.9608 remote nodes per
// token, 0.1201 of its 8 rows, against Loom's all-to-all's 8 of 16 ranks' rows (0.5): the cross-node
// bytes scale by 0.2402, and DeepEP moves them at 50 GB/s, Loom at 40. (The count before 2026-11-29 took 2 x 4 / 8 = 1 node as all a token can
// reach: 1/16 of the rows, half the bytes.)
TEST(PlanPublished, DeepEpCountsTheNodesATokensGroupsSpan) {
  const auto& spec = loom::models::get_spec("deepseek_v3");
  const auto args = spec.build_args({"671B", 129280, 4096, 0});
  const auto shape = loom::plan::ModelShape::of(spec, *args);
  ASSERT_EQ(shape.moe_groups, 8);
  ASSERT_EQ(shape.moe_topk_groups, 4);
  Published row = deepseek_v3_256();
  row.global_rows = 16;
  row.split_points = "";
  loom::plan::Layout layout;
  layout.dp_shard = 16;
  layout.ep = 16;
  layout.local_batch_size = 1;
  layout.ac_mode = "none";
  layout.float8 = "off";
  loom::train::JobConfig config = config_of(row);
  layout.apply_to(config);
  loom::plan::Cluster loom_ep = published_system();
  loom_ep.ep_node_dedup = false;
  const auto deepep = loom::plan::estimate_time(spec, *args, shape, config, layout, published_system());
  const auto all_to_all = loom::plan::estimate_time(spec, *args, shape, config, layout, loom_ep);
  // 4 all-to-alls (no AC) per MoE layer and micro-batch, one 20 us latency each (the peers at once), the same for both.
  const double latency = 4.0 * static_cast<double>(shape.moe_layers) * 20e-6;
  double p_touched = 0;
  const double ways[] = {16, 36, 16, 1};
  for (int j = 1; j <= 4; ++j) p_touched += ways[j - 1] / 70 * (1 - std::pow(1 - j / 4.0, 8));
  EXPECT_NEAR(p_touched, 0.9608, 1e-4);
  const double share = p_touched / 8;  // remote nodes per token over its 8 rows
  const double nic = loom_ep.inter_node_bw / loom_ep.ep_inter_node_bw;  // DeepEP at line rate: 40 / 50
  EXPECT_NEAR(deepep.ep_s - latency, share / 0.5 * nic * (all_to_all.ep_s - latency), 1e-3 * (deepep.ep_s - latency));
}

}  // namespace plan_published_test

namespace plan_published_test {

// NVIDIA's other stack on the same machines: Megatron-Bridge's H100 performance recipes (BF16,
// docs.nvidia.com/nemo/megatron-bridge/nightly/apidocs/bridge/bridge.perf_recipes.llama.h100.llama3.html
// and ...perf_recipes.gpt_oss.h100.gpt_oss.html) lay the same models out on the same 64 GPUs
// differently from NeMo AutoModel: Llama 3 70B as TP 4 x PP 4 x CP 2 (GBS 256, seq 8192), GPT-OSS
// 120B as PP 4 x EP 8 (GBS 1280, seq 4096) -- no full recompute, EP inside a node -- the family the
// planner ranks first where NeMo AutoModel's layouts rank low (docs/planner.md). The 70B recipe's
// BF16 throughput is not in Megatron-Bridge's tables (its FP8 TP 4 x PP 8 is, above); the 120B's is
// (26.02: 5,993 tokens/s at MBS 1), and the planner over-predicts it by 99 % (above): its rank here
// is the planner's, not a measurement's (micro-batch 1; the 70B's Interleaved1F1B with the
// planner's default stages, the 120B's 1F1B).
TEST(PlanPublished, MegatronBridgeRecipeLayoutsRankInTheTopTenPercent) {
  Published llama{"Llama 3 70B, 64 GPUs, Megatron-Bridge TP 4 x PP 4 x CP 2", "llama3", "70B", 128256, 8192, 256, {}, "", 0};
  llama.layout.dp_shard = 2;
  llama.layout.tp = 4;
  llama.layout.pp = 4;
  llama.layout.cp = 2;
  llama.layout.schedule = "Interleaved1F1B";
  llama.layout.microbatch_size = 1;
  llama.layout.local_batch_size = 128;
  EXPECT_LE(rank_of(llama), 0.10);
  Published oss{"GPT-OSS 120B, 64 GPUs, Megatron-Bridge PP 4 x EP 8", "gpt_oss", "120B", 201088, 4096, 1280, {}, "", 5993};
  oss.layout.dp_shard = 16;
  oss.layout.pp = 4;
  oss.layout.ep = 8;
  oss.layout.schedule = "1F1B";
  oss.layout.microbatch_size = 1;
  oss.layout.local_batch_size = 80;
  EXPECT_LE(rank_of(oss), 0.10);
}

}  // namespace plan_published_test

namespace plan_published_test {

// NVIDIA's other stack on the same machines: Megatron-Bridge's performance summary, pre-training,
// DGX-H100 (NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary-archive.md: the NeMo 25.11 and
// 26.02 containers' tables; 25.09's repeat the same layouts within 4 %). Megatron's runs, not
// Loom's: Transformer Engine's kernels (the efficiency above) and its FP8 "current scaling" --
// per-tensor dynamic scales, the recipe Loom calls tensorwise -- on every linear of the blocks,
// priced at the H100's FP8 / BF16 peak ratio, 2 (Cluster::float8_gemm_speedup; not fitted: the
// 8B row alone would fit 2.01). Megatron's data parallelism is DDP with the distributed optimizer
// (FSDP 0), priced as Loom's FSDP over the same ranks (under PP Loom keeps a stage's parameters
// gathered, which is DDP's traffic plus the optimizer's sharding). VP v: Loom's interleaved
// schedule with pp x v stages. The rows Loom cannot express are left out: the MoE rows in FP8
// (Qwen3-30B-A3B on 16 GPUs, Qwen3-235B-A22B on 256, DeepSeek-V3 on 1,024 with blockwise FP8) --
// Loom's Float8 covers the dense linears, not the grouped expert GEMMs -- and the token-dropping
// ones (Loom's MoE is dropless).
Published megatron_dense(const std::string& what, const std::string& flavor, int64_t gbs, double tps) {
  return Published{what, "llama3", flavor, 128256, 8192, gbs, {}, "", tps};
}
std::string even_split(int layers, int stages) {  // the first layer of stages 1..stages-1, two layers each
  std::string out;
  for (int i = 1; i < stages; ++i) out += c10::str(out.empty() ? "" : ",", "layers.", i * layers / stages);
  return out;
}
std::vector<Published> megatron_rows() {
  std::vector<Published> rows;
  Published r = megatron_dense("Megatron Llama 3 8B, 8 GPUs, FP8, DP 8, GBS 128", "8B", 128, 14451);
  r.layout.dp_shard = 8;
  r.layout.local_batch_size = 1;
  rows.push_back(r);
  for (const auto& [gbs, tps] : {std::pair<int64_t, double>{128, 1602}, {256, 1621}}) {
    r = megatron_dense(c10::str("Megatron Llama 3 70B, 64 GPUs, FP8, TP 4 x PP 8 (VP 5), GBS ", gbs), "70B", gbs, tps);
    r.split_points = even_split(80, 40);
    r.layout.dp_shard = 2, r.layout.tp = 4, r.layout.pp = 8, r.layout.schedule = "Interleaved1F1B";
    r.layout.microbatch_size = 1, r.layout.local_batch_size = gbs / 2;
    rows.push_back(r);
  }
  // 126 layers in 64 stages: Megatron's recipe counts the embedding and the loss as a layer each
  // (account_for_embedding/loss_in_pipeline_split), so the first and last stages hold one block.
  std::string split;
  for (int layer = 1; layer <= 125; layer += 2) split += c10::str(split.empty() ? "" : ",", "layers.", layer);
  for (const auto& [gbs, tps] : {std::pair<int64_t, double>{512, 292}, {1536, 311}}) {
    r = megatron_dense(c10::str("Megatron Llama 3.1 405B, 1024 GPUs, FP8, TP 8 x PP 8 (VP 8) x CP 2, GBS ", gbs), "405B",
                       gbs, tps);
    r.split_points = split;
    r.layout.dp_shard = 8, r.layout.cp = 2, r.layout.tp = 8, r.layout.pp = 8, r.layout.schedule = "Interleaved1F1B";
    r.layout.microbatch_size = 1, r.layout.local_batch_size = gbs / 8;
    rows.push_back(r);
  }
  for (const auto& [gbs, mbs, tps] : {std::tuple<int64_t, int64_t, double>{512, 4, 5630}, {1280, 1, 5993}}) {
    Published oss{c10::str("Megatron GPT-OSS 120B, 64 GPUs, PP 4 x EP 8, GBS ", gbs, ", MBS ", mbs), "gpt_oss", "120B",
                  201088, 4096, gbs, {}, "", tps};
    oss.layout.dp_shard = 16, oss.layout.pp = 4, oss.layout.ep = 8, oss.layout.schedule = "1F1B";
    oss.layout.microbatch_size = mbs, oss.layout.local_batch_size = gbs / 16;
    rows.push_back(oss);
  }
  return rows;
}
bool megatron_fp8(const Published& row) { return row.model == "llama3"; }

constexpr double kTransformerEngineFp8Speedup = 2.0;  // the H100's 1,979 / 989 TFLOP/s

loom::plan::Priced price_megatron(const Published& row) {
  loom::plan::Cluster cluster = published_system();
  cluster.float8_gemm_speedup = kTransformerEngineFp8Speedup;
  loom::train::JobConfig config = config_of(row);
  const bool fp8 = megatron_fp8(row);
  config.float8.enable = fp8;
  const auto& spec = loom::models::get_spec(row.model);
  const auto args = spec.build_args({row.flavor, row.vocab, row.seq, 0});
  const auto shape = loom::plan::ModelShape::of(spec, *args);
  loom::plan::Layout layout = row.layout;
  layout.float8 = fp8 ? "on" : "off";
  layout.grad_accum_steps = row.global_rows / (layout.local_batch_size * layout.dp_shard * layout.dp_replicate);
  layout.apply_to(config);
  return loom::plan::fastest_fitting(spec, *args, shape, config, layout, cluster, cluster.memory_gib);
}

// Held out, every one. The five dense FP8 rows within +-25 %; the two GPT-OSS rows are
// over-predicted (+28 % at MBS 4, +99 % at MBS 1: Megatron's own count, 153-163 model TFLOP/s,
// is 16 % MFU, where its GB200 runs of the model reach 43-57 %), printed and not held to it (docs/planner.md).
// With NeMo AutoModel's six (5 within) and TorchTitan's three (3 within, test_time_model.cpp):
// 13 of the 16 held-out rows within +-25 %, issue 50's 80 %.
TEST(PlanPublished, HeldOutMegatronBridgeRowsErrorDistribution) {
  std::vector<double> errors;
  for (const Published& row : megatron_rows()) {
    const auto p = price_megatron(row);
    print(p, row);
    EXPECT_TRUE(p.fits) << row.what << ": " << p.memory.describe();
    EXPECT_EQ(p.layout.float8 == "on", megatron_fp8(row)) << row.what;
    errors.push_back(error_of(p, row));
    if (megatron_fp8(row)) EXPECT_LE(std::abs(error_of(p, row)), 0.25) << row.what;
  }
  for (const Published& row : nemo_rows()) errors.push_back(error_of(price(row, published_system()), row));
  std::vector<double> sorted = errors;
  std::sort(sorted.begin(), sorted.end(), [](double a, double b) { return std::abs(a) < std::abs(b); });
  const auto within = std::count_if(errors.begin(), errors.end(), [](double e) { return std::abs(e) <= 0.25; });
  double mean_abs = 0;
  for (double e : errors) mean_abs += std::abs(e) / static_cast<double>(errors.size());
  std::printf("held-out Megatron-Bridge and NeMo AutoModel rows: %lld of %zu within +-25 %%; |error| median %.1f %%, "
              "mean %.1f %%, max %.1f %%\n",
              static_cast<long long>(within), errors.size(), 100 * std::abs(sorted[sorted.size() / 2]), 100 * mean_abs,
              100 * std::abs(sorted.back()));
  EXPECT_GE(within, 10);  // + TorchTitan's 3 of 3: 13 of 16
}

// The same FP8 rows priced with Loom's own Float8 (torchao's class, the preset's 1.434): only the
// linears' share f of the compute changes, by (1 - f + f / 2) / (1 - f + f / 1.434) -- Loom's
// kernels would run these layouts about 20 % slower than Megatron's, what the planner tells a
// Loom user.
TEST(PlanPublished, MegatronFp8RowsWithLoomsFloat8AreSlower) {
  for (const Published& row : megatron_rows()) {
    if (!megatron_fp8(row)) continue;
    const auto te = price_megatron(row);
    loom::plan::Cluster loom_f8 = published_system();
    loom::train::JobConfig config = config_of(row);
    config.float8.enable = true;
    const auto& spec = loom::models::get_spec(row.model);
    const auto args = spec.build_args({row.flavor, row.vocab, row.seq, 0});
    const auto shape = loom::plan::ModelShape::of(spec, *args);
    loom::plan::Layout layout = te.layout;
    layout.apply_to(config);
    const auto loom = loom::plan::estimate_time(spec, *args, shape, config, layout, loom_f8);
    EXPECT_LT(loom.tokens_per_device_s, te.time.tokens_per_device_s) << row.what;
    const double f = loom::plan::linear_flop_fraction(spec, *args, shape, row.seq);
    EXPECT_NEAR(te.time.compute_s / loom.compute_s, (1 - f + f / 2) / (1 - f + f / loom_f8.float8_gemm_speedup), 1e-9)
        << row.what;
  }
}

}  // namespace plan_published_test
