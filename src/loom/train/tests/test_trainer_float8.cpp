// Float8 linears through `loom train` (docs/float8.md) on the tiny model, CPU emulation:
//   - the Float8 run's losses track the float32 run's (the quantization error is small);
//   - FSDP 2 with Float8 gives one process's losses with Float8, the one process accumulating the
//     same two 4-row micro-batches the two ranks train on: the weight gradient's row-wise scales
//     are taken over the tokens of one micro-batch (one rank's), so a single 8-row batch would
//     quantize differently, by design of the recipe;
//   - activation checkpointing recomputes the Float8 linears bitwise (full AC, one process and
//     FSDP 2);
//   - TP 2 and PP 2 with Float8 give one process's losses (the scales follow the TP placements);
//   - the layouts Float8 does not support, a layer whose dims the float8 GEMMs cannot take and a
//     misspelt recipe are one-line errors with exit 2.
#include <gtest/gtest.h>

#include <cstdio>

#include "loom/train/tests/layout_runs.h"

namespace {
using loom::testing::layout_train_args;
using loom::testing::loom_command;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;
using loom::testing::worst_relative;

using loom::testing::losses;

constexpr int kFloat8Steps = 20;
const std::string kFloat8 = " --float8.enable=true";

// `checked`: the run whose agreement the test checks (the mutation check's flags go to it).
std::vector<double> train(const std::string& name, int nproc, int local_batch, const std::string& flags,
                          bool checked = false, int steps = kFloat8Steps) {
  TempDir dir(name);
  const std::string breakage = checked ? loom::testing::layout_breakage() : "";
  RunResult r = run(loom_command(nproc, layout_train_args(dir, steps, local_batch, flags + breakage)), 600);
  EXPECT_EQ(r.exit_code, 0) << name << "\n" << r.output;
  // The one log line of the conversion: 7 projections per block (the tiny model's 4, the debug
  // model's 6); the head kept. (A pipeline rank converts its stage's.)
  if (r.exit_code == 0 && flags.find("float8") != std::string::npos &&
      flags.find("pipeline_parallel_degree") == std::string::npos) {
    const int linears = 7 * (flags.find("debugmodel") != std::string::npos ? 6 : 4);
    const std::string recipe = flags.find("tensorwise") != std::string::npos ? "tensorwise" : "rowwise";
    EXPECT_NE(r.output.find("float8: " + std::to_string(linears) +
                            " linears to float8 (" + recipe + "), 1 kept in high precision: output"),
              std::string::npos)
        << name << "\n" << r.output;
  }
  return losses(dir);
}

// On the debug model (dim 256, 6 layers), the file's only runs of it: the quantization error grows
// with the GEMMs' inner dimension, and the tiny model's 64 would make tracking easy.
TEST(TrainerFloat8, TracksFloat32) {
  const std::string single = " --parallelism.data_parallel_shard_degree=1 --model.flavor=debugmodel";
  // 30 steps: long enough for the debug model's loss to fall by 15 %.
  constexpr int kTrackSteps = 30;
  const auto fp32 = train("fp32", 1, 4, single, false, kTrackSteps);
  const auto one = train("float8", 1, 4, single + kFloat8, true, kTrackSteps);
  ASSERT_EQ(fp32.size(), static_cast<size_t>(kTrackSteps));
  ASSERT_EQ(one.size(), static_cast<size_t>(kTrackSteps));
  EXPECT_LT(one.back(), one.front() * 0.85) << "Float8 training learns";
  const double worst = worst_relative(fp32, one);
  const double last = std::abs(one.back() - fp32.back()) / fp32.back();
  std::printf("float8 vs float32 over %d steps: worst per-step %.3g, last step %.3g (%.4f vs %.4f)\n", kTrackSteps,
              worst, last, one.back(), fp32.back());
  EXPECT_LE(worst, 0.01);
  EXPECT_LE(last, 0.005);
}

// FSDP 2 (4 rows per rank) against one process accumulating the same two 4-row micro-batches.
// Without gradient clipping the two are bitwise equal: same rows per micro-batch, so the same
// scales; the halved loss of accumulation scales dy by exactly 1/2, which power-of-2 scales absorb
// exactly; (g0 + g1) / 2 == g0 / 2 + g1 / 2 in floating point. With clipping (max_norm = 1, active
// from step 8 here) FSDP's gradient norm sums its shards' squares in another order than one
// process does, so from then on the float32 runs differ by ~1e-7 relative, and float8 rounding,
// a step function of the weights, amplifies such differences ~100-1000x (measured up to ~6e-5
// over 30 steps; the test runs 20): there the check is that float8 equals one process exactly as long as float32
// does, and stays within 3e-4 after.
TEST(TrainerFloat8, Fsdp2EqualsOneProcess) {
  const std::string single = " --parallelism.data_parallel_shard_degree=1 --training.global_batch_size=8";
  const std::string fsdp2 = " --parallelism.data_parallel_shard_degree=2";
  const std::string no_clip = " --training.max_norm=1e6";
  const auto one = train("one_noclip", 1, 4, single + kFloat8 + no_clip);
  const auto two = train("fsdp2_noclip", 2, 4, fsdp2 + kFloat8 + no_clip, true);
  ASSERT_EQ(one.size(), static_cast<size_t>(kFloat8Steps));
  ASSERT_EQ(two.size(), static_cast<size_t>(kFloat8Steps));
  const double worst = worst_relative(one, two);
  std::printf("float8, no clipping: FSDP 2 vs one process, worst per-step relative difference %.3g\n", worst);
  EXPECT_LE(worst, 1e-6);

  const auto fp32_one = train("fp32_one", 1, 4, single);
  const auto fp32_two = train("fp32_fsdp2", 2, 4, fsdp2);
  const auto f8_one = train("float8_one", 1, 4, single + kFloat8);
  const auto f8_two = train("float8_fsdp2", 2, 4, fsdp2 + kFloat8, true);
  ASSERT_EQ(fp32_two.size(), static_cast<size_t>(kFloat8Steps));
  ASSERT_EQ(f8_two.size(), static_cast<size_t>(kFloat8Steps));
  size_t same = 0;  // leading steps on which the float32 layouts agree bitwise
  while (same < fp32_one.size() && fp32_one[same] == fp32_two[same]) ++same;
  EXPECT_GE(same, 5u) << "the float32 layouts should agree bitwise before clipping starts";
  for (size_t i = 0; i < same; ++i) EXPECT_EQ(f8_one[i], f8_two[i]) << "step " << i + 1;
  const double clipped = worst_relative(f8_one, f8_two);
  std::printf("with clipping: float32 layouts bitwise for %zu steps, then within %.3g; float8 layouts "
              "within %.3g\n", same, worst_relative(fp32_one, fp32_two), clipped);
  EXPECT_LE(clipped, 3e-4);
}

// Float8 with tensor and pipeline parallelism (issue 28), 20 steps without clipping (see above):
//   - TP 2 (sequence parallel) against one process on the same 8-row batch: the rowwise-parallel
//     linears' forward and the colwise ones' input gradient contract a sharded dim, so their row-wise
//     amaxes are all-reduced over tp and every rank quantizes its shard with the whole weight's
//     scales; what remains is the order of the TP partial sums;
//   - PP 2 (1F1B, 4 micro-batches of 2 rows) against one process accumulating the same four 2-row
//     micro-batches (the weight gradients' scales are per micro-batch, as above);
//   - the tensorwise recipe under TP 2 too (every sharded operand's amax reduced), 10 steps.
// Each within 1e-5 of its reference per step; the measured differences are printed.
TEST(TrainerFloat8, TensorAndPipelineParallelEqualOneProcess) {
  constexpr int kSteps = 20;
  const std::string no_clip = " --training.max_norm=1e6";
  const std::string single = " --parallelism.data_parallel_shard_degree=1" + no_clip;
  const std::string tp2 = " --parallelism.data_parallel_shard_degree=1 --parallelism.tensor_parallel_degree=2" + no_clip;
  const std::string pp2 = " --parallelism.data_parallel_shard_degree=1 --parallelism.pipeline_parallel_degree=2"
                          " --parallelism.pipeline_parallel_schedule=1F1B --parallelism.pipeline_parallel_microbatch_size=2" +
                          no_clip;
  const std::string tensorwise = " --float8.recipe=tensorwise";
  const auto one = train("one", 1, 8, single + kFloat8, false, kSteps);
  const auto tp = train("tp2", 2, 8, tp2 + kFloat8, true, kSteps);
  // Tensor-wise on 10 steps (suite time): it exercises the reductions of every sharded operand.
  constexpr int kTensorwiseSteps = 10;
  const auto one_tw = train("one_tensorwise", 1, 8, single + kFloat8 + tensorwise, false, kTensorwiseSteps);
  const auto tp_tw = train("tp2_tensorwise", 2, 8, tp2 + kFloat8 + tensorwise, true, kTensorwiseSteps);
  const auto accumulated = train("one_accumulated", 1, 2, single + kFloat8 + " --training.global_batch_size=8", false, kSteps);
  const auto pp = train("pp2", 2, 8, pp2 + kFloat8, true, kSteps);
  for (const auto* run : {&one, &tp, &accumulated, &pp}) ASSERT_EQ(run->size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(tp_tw.size(), static_cast<size_t>(kTensorwiseSteps));
  EXPECT_LT(one.back(), one.front());
  const double worst_tp = worst_relative(one, tp), worst_tw = worst_relative(one_tw, tp_tw),
               worst_pp = worst_relative(accumulated, pp);
  std::printf("float8 rowwise, TP 2 vs one process: worst per-step relative difference %.3g\n"
              "float8 tensorwise, TP 2 vs one process (10 steps): %.3g\n"
              "float8 rowwise, PP 2 (1F1B, 4 x 2 rows) vs one process accumulating 4 x 2 rows: %.3g\n",
              worst_tp, worst_tw, worst_pp);
  EXPECT_LE(worst_tp, 1e-5);
  EXPECT_LE(worst_tw, 1e-5);
  EXPECT_LE(worst_pp, 1e-5);
}

TEST(TrainerFloat8, ActivationCheckpointingRecomputesFloat8LinearsBitwise) {
  const std::string single = " --parallelism.data_parallel_shard_degree=1";
  const std::string fsdp2 = " --parallelism.data_parallel_shard_degree=2";
  const std::string full = " --activation_checkpoint.mode=full";
  const std::string per_op = " --activation_checkpoint.mode=selective --activation_checkpoint.selective_ac_option=op";
  EXPECT_EQ(train("single", 1, 8, single + kFloat8), train("single_full", 1, 8, single + kFloat8 + full, true));
  EXPECT_EQ(train("fsdp2", 2, 4, fsdp2 + kFloat8), train("fsdp2_op", 2, 4, fsdp2 + kFloat8 + per_op, true));
}

TEST(TrainerFloat8, UnsupportedLayoutsAndRecipesAreOneLineUsageErrors) {
  struct Case {
    const char* name;
    int nproc;
    std::string flags;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"async_tp2", 2,
       " --parallelism.tensor_parallel_degree=2 --parallelism.enable_async_tensor_parallel=true"
       " --parallelism.data_parallel_shard_degree=1" + kFloat8,
       "float8.enable = true does not compose with parallelism.enable_async_tensor_parallel"},
      // A vocabulary padded to 2050 rows and no filter: the head (64 -> 2050) cannot be float8.
      {"dims", 1, " --parallelism.data_parallel_shard_degree=1 --model.vocab_size=2050 --float8.filter_fqns=" + kFloat8,
       "float8: linear 'output' is 64 -> 2050 features, but float8 GEMMs need both to be multiples of 16; "
       "add it to float8.filter_fqns"},
      {"recipe", 1, " --parallelism.data_parallel_shard_degree=1 --float8.recipe=rowwize" + kFloat8,
       "did you mean \"rowwise\"?"},
  };
  for (const Case& c : cases) {
    TempDir dir(c.name);
    RunResult r = run(loom_command(c.nproc, layout_train_args(dir, 2, 8, c.flags)), 300);
    EXPECT_EQ(r.exit_code, 2) << c.name << "\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.name << "\n" << r.output;
  }
}

}  // namespace
