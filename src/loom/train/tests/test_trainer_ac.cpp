// Activation checkpointing through `loom train` (issue 13's acceptance): 6 steps of the tiny
// model with full, selective every 2nd block and selective per op give per-step losses and gradient
// norms bitwise
// equal to no checkpointing, in one process, under FSDP 2 (the recompute reads parameters FSDP
// re-gathered in backward; the reduce-scatters are not repeated), under TP 2 and async TP 2
// (sequence-parallel collectives re-run in the recompute) and under CP 2 (ring attention,
// block-causal; FSDP over the cp ranks). Bitwise because the recompute runs the same kernels on the
// same values and the gradients accumulate in the same order. The bytes each rank sends per step
// (metrics.jsonl's comm_bytes) show where the recompute communicates: under FSDP not at all (the
// recompute reads the parameters FSDP re-gathers for backward anyway, and each group is
// reduce-scattered once), under TP the recomputed blocks' sequence all-gathers and
// reduce-scatters once more.
#include <gtest/gtest.h>

#include <fstream>

#include "loom/train/tests/layout_runs.h"

namespace {
using loom::testing::Layout;
using loom::testing::layout_train_args;
using loom::testing::loom_command;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

using loom::testing::losses;

double comm_bytes_per_step(const TempDir& dir) {
  const auto rows = loom::testing::read_jsonl(dir.path() / "metrics.jsonl");
  return rows.back()["comm_bytes"].get<double>();
}

struct Mode {
  const char* name;
  std::string flags;
};

const std::vector<Mode>& modes() {
  static const std::vector<Mode> all = {
      {"full", "--activation_checkpoint.mode=full"},
      {"selective_2", "--activation_checkpoint.mode=selective --activation_checkpoint.selective_ac_option=2"},
      {"selective_op", "--activation_checkpoint.mode=selective --activation_checkpoint.selective_ac_option=op"},
  };
  return all;
}

// One test per layout: the layout without AC, then with each mode, 6 steps each.
class TrainerACLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(TrainerACLayout, EveryModeTrainsBitwiseLikeNoCheckpointing) {
  constexpr int kSteps = 6;
  const Layout& l = GetParam();
  TempDir reference(std::string(l.name) + "_none");
  RunResult ref = run(loom_command(l.nproc, layout_train_args(reference, kSteps, l.local_batch, l.flags)), 600);
  ASSERT_EQ(ref.exit_code, 0) << l.name << "\n" << ref.output;
  const auto want = losses(reference);
  const double want_bytes = comm_bytes_per_step(reference);
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps)) << l.name;
  EXPECT_LT(want.back(), want.front()) << l.name;
  for (const Mode& m : modes()) {
    TempDir dir(std::string(l.name) + "_" + m.name);
    RunResult r = run(loom_command(l.nproc, layout_train_args(dir, kSteps, l.local_batch,
                                                              l.flags + " " + m.flags + loom::testing::layout_breakage())),
                      600);
    ASSERT_EQ(r.exit_code, 0) << l.name << " " << m.name << "\n" << r.output;
    EXPECT_NE(r.output.find("activation checkpointing: "), std::string::npos) << r.output;
    const auto got = losses(dir);
    // The gradient norms too (clipping engages: layout_runs.h's max_norm).
    const auto want_norms = loom::testing::logged_grad_norms(reference.path());
    const auto got_norms = loom::testing::logged_grad_norms(dir.path());
    ASSERT_EQ(want_norms.size(), want.size()) << l.name;
    if (std::string(l.name).find("ZBV") != std::string::npos) {
      EXPECT_LE(loom::testing::worst_relative(want, got), 1e-5) << m.name;
      EXPECT_LE(loom::testing::worst_relative(want_norms, got_norms), 1e-5) << m.name << ": gradient norms";
    } else {
      EXPECT_EQ(got, want) << l.name << " " << m.name << ": per-step losses must be bitwise those without AC";
      EXPECT_EQ(got_norms, want_norms) << l.name << " " << m.name << ": per-step gradient norms must be bitwise";
    }
    const double bytes = comm_bytes_per_step(dir);
    if (std::string(l.name) == "fsdp2") {
      EXPECT_EQ(bytes, want_bytes) << m.name << ": no extra all-gather or reduce-scatter under FSDP";
    } else if (std::string(l.name) == "tp2") {
      // The recomputed blocks run their forward collectives (SP gathers, reduce-scatters) again.
      EXPECT_GT(bytes, want_bytes) << m.name;
    }
    std::printf("%-9s %-13s comm bytes per step %.0f (no AC %.0f)\n", l.name, m.name, bytes, want_bytes);
    std::printf("%-9s %-13s %d steps: losses %s no AC's (%.6f -> %.6f; max relative difference %.2e)\n", l.name,
                m.name, kSteps, got == want ? "bitwise equal to" : "differ from", got.front(), got.back(),
                loom::testing::worst_relative(want, got));
  }
}

INSTANTIATE_TEST_SUITE_P(
    EveryLayout, TrainerACLayout,
    ::testing::Values(
        Layout{"single", 1, 8, "--parallelism.data_parallel_shard_degree=1"},
        Layout{"fsdp2", 2, 4, "--parallelism.data_parallel_shard_degree=2"},
        Layout{"tp2", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
        // Async TP: the projections' collective matmuls (their own around-hooks) are recomputed even
        // per op; context parallel ring attention, block-causal: per op keeps the ring's own graph.
        Layout{"tp2_async", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"
                                  " --parallelism.enable_async_tensor_parallel=true"},
        Layout{"cp2_ring", 2, 8, "--parallelism.context_parallel_degree=2 --parallelism.context_parallel_rotate_method=ring"
                                 " --model.attention_mask=block_causal"},
        // Pipeline stages: each stage's blocks are checkpointed. 1F1B runs whole backwards (bitwise);
        // ZBVZeroBubble splits them into I and W, and a checkpointed block's weight gradients come
        // from autograd in I where the stage's W computes them with its own formulas otherwise, so
        // there the losses agree to float32 rounding (1e-5), not bitwise.
        Layout{"pp2_1F1B", 2, 8, "--parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_schedule=1F1B"
                                 " --parallelism.pipeline_parallel_microbatch_size=2 --parallelism.data_parallel_shard_degree=1"},
        Layout{"pp2_ZBV", 2, 8, "--parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_schedule=ZBVZeroBubble"
                                " --parallelism.pipeline_parallel_microbatch_size=2 --parallelism.data_parallel_shard_degree=1"},
        // TP inside the stages: the I/W split goes through autograd (I = grad of the stage input on a
        // retained graph, W = backward with inputs = parameters), which runs a checkpoint node twice.
        Layout{"pp2_tp2_ZBV", 4, 8, "--parallelism.pipeline_parallel_degree=2 --parallelism.tensor_parallel_degree=2"
                                    " --parallelism.pipeline_parallel_schedule=ZBVZeroBubble"
                                    " --parallelism.pipeline_parallel_microbatch_size=2 --parallelism.data_parallel_shard_degree=1"}),
    loom::testing::layout_test_name);

}  // namespace
