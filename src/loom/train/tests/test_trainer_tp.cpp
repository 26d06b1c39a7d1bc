// Tensor parallelism through `loom train` (issue 10's acceptance): every TP layout trains the same
// model as the single process with the same global batch, step by step, and checkpoints move
// between TP, FSDP x TP and single-process layouts. Runs the tiny model on the default corpus.
//
// Tolerances: TP splits the rowwise matmuls' inner sums and the loss's softmax sums across ranks
// (and its loss uses ATen's exp where the single-process CPU kernel uses a 1-ulp polynomial), so
// the reduction order differs from the single process and per-step losses agree to float32
// rounding, not bitwise: within 1e-5 relative (measured figures printed below). The
// runs use lr 1e-3: at the debug config's 4e-3 the loss spikes near step 20 and any rounding
// difference (TP's or another thread count's) grows ~100x there, which would measure the spike,
// not TP. A layout compared with itself (resume at the same layout) is bitwise.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/build_paths.h"
#include "loom/train/tests/layout_runs.h"

namespace {
using loom::testing::bin_dir;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

using loom::testing::Layout;
using loom::testing::worst_relative;

using loom::testing::layout_train_args;
using loom::testing::loom_command;

using loom::testing::losses;

}  // namespace

// The single process with 8 rows per step against: TP 2 and 4 (sequence parallel and loss
// parallel on), TP 2 with each of them off, FSDP 2 x TP 2 and DDP 2 x TP 2 (HSDP with one shard)
// on 4 ranks, FSDP 2 x TP 2 accumulating two micro-batches of 2 rows, async TP alone and under
// FSDP, and HSDP 2 x 2 x TP 2 on 8 ranks (the 3-D mesh dp_replicate x dp_shard x tp). One test
// per layout against one cached single-process run; 10 steps (the loss-spike note above: more
// steps at lr 1e-3 prove no more).
class TrainerTPLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(TrainerTPLayout, TrainsLikeTheSingleProcess) {
  loom::testing::expect_layout_matches_single_process(GetParam(), "", 10, {1e-5, 1e-5});
}

INSTANTIATE_TEST_SUITE_P(
    EveryLayout, TrainerTPLayout,
    ::testing::Values(
        Layout{"tp2", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
        Layout{"tp4", 4, 8, "--parallelism.tensor_parallel_degree=4 --parallelism.data_parallel_shard_degree=1"},
        Layout{"tp2_no_sp", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"
                                  " --parallelism.disable_sequence_parallel=true"},
        Layout{"tp2_no_loss_parallel", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"
                                             " --parallelism.disable_loss_parallel=true"},
        Layout{"fsdp2_tp2", 4, 4, "--parallelism.tensor_parallel_degree=2"},
        Layout{"ddp2_tp2", 4, 4, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_replicate_degree=2"
                                 " --parallelism.data_parallel_shard_degree=1"},
        Layout{"fsdp2_tp2_accum2", 4, 2, "--parallelism.tensor_parallel_degree=2 --training.global_batch_size=8"},
        Layout{"tp2_async", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"
                                  " --parallelism.enable_async_tensor_parallel=true"},
        Layout{"fsdp2_tp2_async", 4, 4, "--parallelism.tensor_parallel_degree=2 --parallelism.enable_async_tensor_parallel=true"},
        Layout{"hsdp2x2_tp2", 8, 2, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_replicate_degree=2"}),
    loom::testing::layout_test_name);

// Checkpoints across TP layouts: an FSDP 2 x TP 2 run saves at step 6 (and goes on to 12);
// resuming from that checkpoint at the same layout continues bitwise, and at TP 4, FSDP 4 and in
// one process it continues like the uninterrupted run (to float32 reduction order, as above).
TEST(TrainerTP, CheckpointsMoveBetweenTensorParallelLayouts) {
  const std::string saving = "--parallelism.tensor_parallel_degree=2 --checkpoint.enable=true --checkpoint.interval=6";
  TempDir whole("whole");
  RunResult w = run(loom_command(4, layout_train_args(whole, 12, 4, saving)), 600);
  ASSERT_EQ(w.exit_code, 0) << w.output;
  const auto uninterrupted = losses(whole);
  ASSERT_EQ(uninterrupted.size(), 12u);
  const std::vector<double> tail(uninterrupted.begin() + 6, uninterrupted.end());
  const auto step6 = whole.path() / "checkpoint" / "step-6";
  ASSERT_TRUE(std::filesystem::exists(step6 / "COMPLETE") || std::filesystem::exists(step6 / "metadata.json"));

  // `loom convert --to hf` reads the TP checkpoint like any other: one process gathers the boxes.
  TempDir hf("hf");
  RunResult convert = run(bin_dir() + "/loom convert --to hf --input " + step6.string() + " --output " +
                          (hf.path() / "model").string());
  ASSERT_EQ(convert.exit_code, 0) << convert.output;
  RunResult score = run(bin_dir() + "/loom score --tokens 5,17,300,42,9 --checkpoint " + (hf.path() / "model").string());
  ASSERT_EQ(score.exit_code, 0) << score.output;
  EXPECT_NE(score.output.find("mean NLL"), std::string::npos) << score.output;

  const std::vector<Layout> layouts = {
      {"fsdp2_tp2", 4, 4, "--parallelism.tensor_parallel_degree=2"},
      {"tp4", 4, 8, "--parallelism.tensor_parallel_degree=4 --parallelism.data_parallel_shard_degree=1"},
      {"fsdp4", 4, 2, "--parallelism.data_parallel_shard_degree=4"},
      {"single", 1, 8, "--parallelism.data_parallel_shard_degree=1"},
  };
  for (const Layout& l : layouts) {
    // The step-6 checkpoint in the run's own checkpoint folder: the run resumes from it (model,
    // optimizer, data loader and schedule state).
    TempDir dir(l.name);
    std::filesystem::create_directories(dir.path() / "checkpoint");
    std::filesystem::copy(step6, dir.path() / "checkpoint" / "step-6", std::filesystem::copy_options::recursive);
    RunResult r = run(loom_command(l.nproc, layout_train_args(dir, 12, l.local_batch, l.flags + " --checkpoint.enable=true")), 600);
    ASSERT_EQ(r.exit_code, 0) << l.name << "\n" << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    const auto got = losses(dir);
    ASSERT_EQ(got.size(), 6u) << l.name;  // steps 7..12
    const double worst = worst_relative(tail, got);
    if (std::string(l.name) == "fsdp2_tp2") {
      EXPECT_EQ(got, tail) << "resuming at the saving layout must be bitwise";
    } else {
      EXPECT_LE(worst, 1e-5) << l.name;
    }
    std::printf("resumed at %-9s steps 7-12: max relative loss difference from the uninterrupted "
                "FSDP 2 x TP 2 run %.2e\n", l.name, worst);
  }
}

// A degree that does not split the model: one line per rank, exit 2, naming what works.
TEST(TrainerTP, DegreeThatDoesNotSplitTheModelIsOneLine) {
  TempDir dir("tp3");
  RunResult r = run(loom_command(3, layout_train_args(dir, 2, 8, "--parallelism.tensor_parallel_degree=3"
                                                     " --parallelism.data_parallel_shard_degree=1")), 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("parallelism.tensor_parallel_degree = 3 does not divide n_heads of the model (4); "
                          "degrees that split this model: 1, 2, 4"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[step "), std::string::npos) << r.output;
}
