// optimizer.name = "Muon" through `loom train`: FSDP 2 and FSDP 4 (each Muon matrix whole on one
// rank), DDP 2 and two pipeline stages (1F1B, 4 micro-batches of 2 rows) train like the single process step by step, a checkpoint saved at FSDP 4 loads at
// FSDP 2 and in one process with its momentum buffers bitwise, and bad settings are one-line
// errors (exit 2).
//
// Tolerance: the layouts sum the gradients of a step in another order (per-rank micro-batches,
// then the reduce-scatter or all-reduce), so gradients agree to float32 rounding, not bitwise; the
// orthogonalisation itself runs on the same whole matrix in every layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "loom/train/tests/layout_runs.h"

namespace {
namespace fs = std::filesystem;
using loom::testing::expect_bitwise_equal_checkpoints;
using loom::testing::gathered_parameters;
using loom::testing::Layout;
using loom::testing::layout_train_args;
using loom::testing::loom_command;
using loom::testing::read_whole_checkpoint;
using loom::testing::resave_checkpoint;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;
using loom::testing::worst_parameter_difference;
using loom::testing::worst_relative;

const std::string kMuon = " --optimizer.name=Muon";

}  // namespace

// Acceptance: FSDP 2, FSDP 4, DDP 2 and PP 2 against the single process with the same global batch
// of 8 rows, 10 steps: per-step losses and the final parameters within 1e-6 (relative).
class TrainerMuonLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(TrainerMuonLayout, TrainsLikeTheSingleProcess) {
  loom::testing::expect_layout_matches_single_process(GetParam(), kMuon, 10, {1e-6, 1e-6});
}

INSTANTIATE_TEST_SUITE_P(
    EveryLayout, TrainerMuonLayout,
    ::testing::Values(
        Layout{"fsdp2", 2, 4, "--parallelism.data_parallel_shard_degree=2"},
        Layout{"fsdp4", 4, 2, "--parallelism.data_parallel_shard_degree=4"},
        Layout{"ddp2", 2, 4, "--parallelism.data_parallel_shard_degree=1 --parallelism.data_parallel_replicate_degree=2"},
        Layout{"pp2", 2, 8, "--parallelism.data_parallel_shard_degree=1 --parallelism.pipeline_parallel_degree=2"
                            " --parallelism.pipeline_parallel_schedule=1F1B --parallelism.pipeline_parallel_microbatch_size=2"}),
    loom::testing::layout_test_name);

// FSDP 4 saves after 2 steps (momentum buffers whole on their owners, empty pieces elsewhere);
// FSDP 2 loads and saves it again, one process loads that and saves again: every tensor bitwise.
TEST(TrainerMuon, CheckpointMovesFromFsdp4ToFsdp2ToOneProcessBitwise) {
  TempDir source("fsdp4"), fsdp2("fsdp2"), single("single");
  const std::string ckpt = " --checkpoint.enable=true --checkpoint.interval=2 --checkpoint.keep_latest_k=0";
  RunResult a = run(loom_command(4, layout_train_args(source, 2, 2, ckpt + kMuon + " --parallelism.data_parallel_shard_degree=4")), 300);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const fs::path step2 = source.path() / "checkpoint" / "step-2";
  ASSERT_TRUE(fs::exists(step2 / "metadata.json")) << a.output;
  const fs::path from_fsdp2 = resave_checkpoint(fsdp2, step2, 2, 2, ckpt + kMuon);
  const fs::path from_single = resave_checkpoint(single, from_fsdp2, 2, 1, ckpt + kMuon);

  const auto original = read_whole_checkpoint(step2);
  size_t buffers = 0;
  expect_bitwise_equal_checkpoints(original, read_whole_checkpoint(from_fsdp2));
  expect_bitwise_equal_checkpoints(original, read_whole_checkpoint(from_single));
  for (const auto& [name, t] : original) buffers += name.ends_with(".momentum_buffer");
  // The tiny model's 4 blocks x 7 matrices; the embedding and the head have AdamW moments instead.
  EXPECT_EQ(buffers, 28u);
  EXPECT_EQ(original.count("optimizer.tok_embeddings.weight.exp_avg"), 1u);
  EXPECT_EQ(original.count("optimizer.tok_embeddings.weight.momentum_buffer"), 0u);
  // The buffers hold the trained state (a checkpoint of zeros would round-trip too).
  for (const char* m : {"layers.0.attention.wq.weight", "layers.3.feed_forward.w2.weight"}) {
    EXPECT_GT(original.at(std::string("optimizer.") + m + ".momentum_buffer").abs().max().item<float>(), 0.0f) << m;
  }
  std::printf("FSDP 4 -> FSDP 2 -> one process: %zu tensors (%zu momentum buffers) bitwise equal\n",
              original.size(), buffers);
}

// Bad settings: one line naming the fix, exit 2, before any training.
TEST(TrainerMuon, BadSettingsAreOneLineErrors) {
  TempDir dir("bad");
  const std::string one = " --parallelism.data_parallel_shard_degree=1";
  struct Case {
    std::string flags;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {" --optimizer.name=Muom", "did you mean \"Muon\""},
      {kMuon + " --parallelism.tensor_parallel_degree=2", "\"Muon\" does not support tensor parallelism"},
      {kMuon + " --optimizer.muon_adjust_lr=spectral", "optimizer.muon_adjust_lr"},
      {kMuon + " --optimizer.muon_ns_steps=0", "optimizer.muon_ns_steps"},
      {kMuon + " --optimizer.muon_momentum=1", "optimizer.muon_momentum"},
  };
  for (const Case& c : cases) {
    RunResult r = run(loom_command(1, layout_train_args(dir, 2, 8, one + c.flags)), 120);
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.flags << "\n" << r.output;
    EXPECT_EQ(r.output.find("[step "), std::string::npos) << r.output;
    const size_t at = r.output.find("error:");
    std::printf("%s\n  -> %s\n", c.flags.c_str(),
                at == std::string::npos ? "(no error line)" : r.output.substr(at, r.output.find('\n', at) - at).c_str());
  }
}
