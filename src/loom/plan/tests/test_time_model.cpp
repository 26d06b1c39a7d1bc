// The time model against TorchTitan's published H100 throughput (docs/planner.md): the H100
// preset's efficiency is fitted on the Llama 3.1 8B, 8-GPU FSDP row; the other rows are predicted
// with it and must be within +-25 %; the ordering of the 405B schedules (Interleaved1F1B over
// 1F1B) must be reproduced.
#include <gtest/gtest.h>

#include <c10/util/StringUtil.h>

#include <cmath>
#include <cstdio>

#include "loom/models/spec.h"
#include "loom/plan/memory_model.h"
#include "loom/plan/search.h"
#include "loom/plan/time_model.h"
#include "loom/train/config.h"

namespace plan_time_test {

struct Row {
  std::string what;
  std::string flavor;
  loom::plan::Layout layout;
  int64_t global_rows;
  double published_tps;  // tokens/s per GPU
};

double predict(const Row& row, const loom::plan::Cluster& cluster) {
  loom::train::JobConfig config = loom::train::parse_config_toml(
      c10::str("[model]\nname = \"llama3\"\nflavor = \"", row.flavor, "\"\nvocab_size = 128256\n",
               "[training]\nseq_len = 8192\nglobal_batch_size = ", row.global_rows, "\n",
               "mixed_precision_param = \"bfloat16\"\n[validation]\nenable = false\n",
               "[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"op\"\n"),
      "test");
  const auto& spec = loom::models::get_spec("llama3");
  const auto args = spec.build_args({row.flavor, 128256, 8192, 0});
  const auto shape = loom::plan::ModelShape::of(spec, *args);
  loom::plan::Layout layout = row.layout;
  layout.grad_accum_steps = row.global_rows / (layout.local_batch_size * layout.dp_shard * layout.dp_replicate);
  layout.apply_to(config);
  return loom::plan::estimate_time(spec, *args, shape, config, layout, cluster).tokens_per_device_s;
}

std::vector<Row> published_rows() {
  loom::plan::Layout fsdp8;
  fsdp8.dp_shard = 8;
  fsdp8.local_batch_size = 2;
  loom::plan::Layout fsdp128 = fsdp8;
  fsdp128.dp_shard = 128;
  loom::plan::Layout three_d;  // 405B on 512 GPUs: FSDP 8 x TP 8 x PP 8
  three_d.dp_shard = 8;
  three_d.tp = 8;
  three_d.pp = 8;
  three_d.local_batch_size = 16;
  three_d.microbatch_size = 1;
  three_d.schedule = "1F1B";
  loom::plan::Layout interleaved = three_d;
  interleaved.schedule = "Interleaved1F1B";
  return {{"8B, 8 GPUs, FSDP (fitted)", "8B", fsdp8, 16, 5762},
          {"8B, 128 GPUs, FSDP", "8B", fsdp128, 256, 5605},
          {"405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, 1F1B", "405B", three_d, 128, 100},
          {"405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, Interleaved1F1B", "405B", interleaved, 128, 128}};
}

TEST(PlanTime, TheH100PresetIsFittedOnTorchTitans8BRowAndPredictsTheOthers) {
  const loom::plan::Cluster h100 = loom::plan::Cluster::preset("h100");
  const std::vector<Row> rows = published_rows();
  std::vector<double> predicted;
  for (const Row& row : rows) {
    const double tps = predict(row, h100);
    predicted.push_back(tps);
    const double error = (tps - row.published_tps) / row.published_tps;
    std::printf("%-55s published %7.0f predicted %7.0f tokens/s per GPU (%+.1f %%)\n", row.what.c_str(),
                row.published_tps, tps, 100 * error);
    EXPECT_LE(std::abs(error), row.what.find("fitted") != std::string::npos ? 0.01 : 0.25) << row.what;
  }
  EXPECT_GT(predicted[3], predicted[2]) << "Interleaved1F1B must beat 1F1B on 405B / 512 GPUs";
}

TEST(PlanTime, FittingTheEfficiencyFindsThePresetsValue) {
  // The preset's efficiency is what bisection on the fitted row gives (within 0.5 %), so the
  // number in Cluster::preset is reproducible from the published figure.
  const Row row = published_rows()[0];
  loom::plan::Cluster cluster = loom::plan::Cluster::preset("h100");
  double lo = 0.05, hi = 1.0;
  for (int i = 0; i < 50; ++i) {
    cluster.efficiency = 0.5 * (lo + hi);
    (predict(row, cluster) < row.published_tps ? lo : hi) = cluster.efficiency;
  }
  std::printf("fitted H100 efficiency: %.4f\n", cluster.efficiency);
  EXPECT_NEAR(cluster.efficiency, loom::plan::Cluster::preset("h100").efficiency,
              0.005 * cluster.efficiency);
}

}  // namespace plan_time_test
