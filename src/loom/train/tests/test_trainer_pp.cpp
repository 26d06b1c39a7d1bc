// Pipeline parallelism through `loom train` (issue 11's acceptance): every schedule at PP 2 with 4
// and 8 micro-batches, and 1F1B and Interleaved1F1B at PP 4, train the tiny model like the single
// process with the same global batch (8 rows of 64 tokens), step by step for 6 steps, and end
// with the same parameters; a checkpoint moves PP 2 -> one process -> PP 4 bitwise; bad pipeline
// settings are one line and exit 2.
//
// Tolerance: the pipeline sums each parameter's gradient over micro-batches (the single process
// computes it from the whole batch at once) and the gradient norm over the pp ranks, so sums run
// in another order: per-step losses within 1e-5 relative, gathered parameters within 1e-5
// (relative L2 per tensor), not bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/state_dict.h"
#include "loom/train/tests/layout_runs.h"

namespace {
namespace fs = std::filesystem;
using loom::testing::bin_dir;
using loom::testing::expect_bitwise_equal_checkpoints;
using loom::testing::gathered_parameters;
using loom::testing::Layout;
using loom::testing::layout_train_args;
using loom::testing::loom_command;
using loom::testing::read_whole_checkpoint;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;
using loom::testing::worst_parameter_difference;
using loom::testing::worst_relative;

constexpr int kSteps = 6;  // parity holds per step; the schedule-driven FSDP layouts run 20 (kScheduleSteps)

// Each layout of `layouts` (+ the model flags; no FSDP unless a layout asks for it) against the one
// cached single-process run of the same model (layout_runs.h): per-step losses and the gathered
// final parameters within `tolerance`.
void expect_pp_layouts_match_single_process(const std::string& model_flags, const std::vector<Layout>& layouts,
                                         double tolerance = 1e-5, int steps = kSteps) {
  for (const Layout& l : layouts) {
    const Layout no_fsdp{l.name, l.nproc, l.local_batch, "--parallelism.data_parallel_shard_degree=1 " + l.flags};
    loom::testing::expect_layout_matches_single_process(no_fsdp, model_flags, steps, {tolerance, tolerance});
  }
}

std::string pp(int degree, const std::string& schedule, int microbatch_rows) {
  return "--parallelism.pipeline_parallel_degree=" + std::to_string(degree) +
         " --parallelism.pipeline_parallel_schedule=" + schedule +
         " --parallelism.pipeline_parallel_microbatch_size=" + std::to_string(microbatch_rows);
}


}  // namespace

// The one-stage-per-rank schedules at PP 2: 8 rows as 4 micro-batches of 2 and 8 of 1; 1F1B also
// accumulating two loaded batches of 4 rows (global batch 8) per step, and with two data-parallel
// replicas of 4 rows each (dp_replicate 2 x pp 2 on 4 ranks).
TEST(TrainerPP, SingleStageSchedulesTrainLikeTheSingleProcess) {
  expect_pp_layouts_match_single_process(
      "", {
              {"pp2_GPipe_m4", 2, 8, pp(2, "GPipe", 2)},
              {"pp2_GPipe_m8", 2, 8, pp(2, "GPipe", 1)},
              {"pp2_1F1B_m4", 2, 8, pp(2, "1F1B", 2)},
              {"pp2_1F1B_m8", 2, 8, pp(2, "1F1B", 1)},
              {"pp2_1F1B_m4_x_2_accumulated", 2, 4, pp(2, "1F1B", 1) + " --training.global_batch_size=8"},
              {"dp2_x_pp2_1F1B_m4", 4, 4, pp(2, "1F1B", 1) + " --parallelism.data_parallel_replicate_degree=2"},
          });
}

// Two stages per rank (the tiny model's 4 layers as 4 stages of one), looped.
TEST(TrainerPP, LoopedSchedulesTrainLikeTheSingleProcess) {
  expect_pp_layouts_match_single_process(
      "", {
              {"pp2_Interleaved1F1B_m4", 2, 8, pp(2, "Interleaved1F1B", 2)},
              {"pp2_Interleaved1F1B_m8", 2, 8, pp(2, "Interleaved1F1B", 1)},
              {"pp2_LoopedBFS_m4", 2, 8, pp(2, "LoopedBFS", 2)},
              {"pp2_LoopedBFS_m8", 2, 8, pp(2, "LoopedBFS", 1)},
              {"pp2_InterleavedZeroBubble_m4", 2, 8, pp(2, "InterleavedZeroBubble", 2)},
              {"pp2_InterleavedZeroBubble_m8", 2, 8, pp(2, "InterleavedZeroBubble", 1)},
          });
}

// The V schedules (rank r holds stages r and 3 - r) and an explicit split.
TEST(TrainerPP, VSchedulesTrainLikeTheSingleProcess) {
  expect_pp_layouts_match_single_process(
      "", {
              {"pp2_ZBVZeroBubble_m4", 2, 8, pp(2, "ZBVZeroBubble", 2)},
              {"pp2_ZBVZeroBubble_m8", 2, 8, pp(2, "ZBVZeroBubble", 1)},
              {"pp2_DualPipeV_m4", 2, 8, pp(2, "DualPipeV", 2)},
              {"pp2_DualPipeV_m8", 2, 8, pp(2, "DualPipeV", 1)},
              {"pp2_1F1B_m4_split_at_layers_1", 2, 8,
               pp(2, "1F1B", 2) + " --parallelism.pipeline_parallel_split_points=layers.1"},
          });
}

// PP 4 on an 8-layer tiny model: 1F1B (one stage of 2 layers per rank) and Interleaved1F1B (8
// stages of one layer, two per rank).
TEST(TrainerPP, FourStagesTrainLikeTheSingleProcess) {
  expect_pp_layouts_match_single_process(
      "--model.n_layers=8", {
                                {"pp4_1F1B_m4", 4, 8, pp(4, "1F1B", 2)},
                                {"pp4_1F1B_m8", 4, 8, pp(4, "1F1B", 1)},
                                {"pp4_Interleaved1F1B_m4", 4, 8, pp(4, "Interleaved1F1B", 2)},
                                {"pp4_Interleaved1F1B_m8", 4, 8, pp(4, "Interleaved1F1B", 1)},
                            });
}

// Block-causal attention (documents packed into a row do not see each other): each micro-batch's
// document ids reach every stage.
TEST(TrainerPP, BlockCausalStagesTrainLikeTheSingleProcess) {
  expect_pp_layouts_match_single_process(
      "--model.attention_mask=block_causal", {
                                                 {"block_causal_pp2_1F1B_m4", 2, 8, pp(2, "1F1B", 2)},
                                                 {"block_causal_pp2_ZBVZeroBubble_m8", 2, 8, pp(2, "ZBVZeroBubble", 1)},
                                                 {"block_causal_tp2_x_pp2_1F1B_m4", 4, 8,
                                                  pp(2, "1F1B", 2) + " --parallelism.tensor_parallel_degree=2"},
                                             });
}

// Tensor parallelism inside the stages (sequence and loss parallel on): TP 2 x PP 2 on 4 ranks with
// a one-stage and a V zero-bubble schedule, and the 3-D layout with two replicas of that pipeline,
// DP 2 x TP 2 x PP 2 on 8 ranks (mesh pp x dp_replicate x tp).
TEST(TrainerPP, TensorParallelStagesTrainLikeTheSingleProcess) {
  const std::string tp2 = " --parallelism.tensor_parallel_degree=2";
  expect_pp_layouts_match_single_process(
      "", {
              {"tp2_x_pp2_1F1B_m4", 4, 8, pp(2, "1F1B", 2) + tp2},
              {"tp2_x_pp2_ZBVZeroBubble_m4", 4, 8, pp(2, "ZBVZeroBubble", 2) + tp2},
              {"dp2_x_tp2_x_pp2_1F1B_m4", 8, 4, pp(2, "1F1B", 1) + tp2 + " --parallelism.data_parallel_replicate_degree=2"},
          });
}

// FSDP inside the stages (issue 11's 3-D layout): the rank's stage is an FSDP root, gathered once
// per step by default (re-gathered per micro-batch under reshard_after_forward = always), whose
// gradients accumulate unsharded over the micro-batches and the accumulated batches and are
// reduce-scattered once, at the stage's REDUCE_GRAD of the step's last batch. FSDP 2 x PP 2 with GPipe
// and with 1F1B accumulating two loaded batches (FSDP 2 x TP 2 x PP 2 on 8 ranks is in the next
// test, with Interleaved1F1B), within the 1e-4 the issue asks of the 3-D layout (FSDP's reduce-scatter and the
// pipeline's micro-batch sums reorder the additions; the measured figures are printed).
TEST(TrainerPP, FsdpStagesTrainLikeTheSingleProcess) {
  const std::string shard2 = " --parallelism.data_parallel_shard_degree=2";
  expect_pp_layouts_match_single_process(
      "", {
              {"fsdp2_x_pp2_GPipe_m4", 4, 4, pp(2, "GPipe", 1) + shard2},
              {"fsdp2_x_pp2_1F1B_m2_x_2_accumulated", 4, 2, pp(2, "1F1B", 1) + shard2 + " --training.global_batch_size=8"},
              {"fsdp2_x_pp2_1F1B_m4_reshard_always", 4, 4,
               pp(2, "1F1B", 1) + shard2 + " --parallelism.fsdp_reshard_after_forward=always"},
          },
      1e-4);
  // By default (TorchTitan's under PP) a stage gathers each group once per step (not once per
  // micro-batch forward and backward): its bytes on dp_shard per step fall to about a gather plus
  // a reduce-scatter of the stage, against 4 micro-batches' gathers under always.
  auto dp_shard_bytes = [&](const std::string& reshard) {
    TempDir d("fsdp_bytes_" + reshard);
    RunResult r = run(loom_command(4, layout_train_args(d, 2, 4, "--parallelism.data_parallel_shard_degree=1 " +
                                                                    pp(2, "GPipe", 1) + shard2 +
                                                                    " --parallelism.fsdp_reshard_after_forward=" + reshard)),
                      300);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    double bytes = 0;
    std::ifstream in(d.path() / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("comm_bytes/dp_shard") && j.value("step", 0) == 2) bytes = j["comm_bytes/dp_shard"].get<double>();
    }
    return bytes;
  };
  const double held = dp_shard_bytes("default"), always = dp_shard_bytes("always");
  std::printf("FSDP 2 x PP 2, GPipe m = 4: dp_shard bytes per step %.0f (default: held) vs %.0f (always): %.2fx\n",
              held, always, always / held);
  EXPECT_GT(held, 0);
  EXPECT_LT(3 * held, always);
}

// FSDP driven by the schedule (issue 28): every stage on a rank is its own FSDP root, gathered at
// its UNSHARD, reduce-scattered at its REDUCE_GRAD (after its last B, or its last W under a
// zero-bubble split) and freed at its RESHARD. TorchTitan's large recipes as the issue lists them,
// 20 steps within 1e-5 of the single process: PP 2 Interleaved1F1B (2 stages per rank) x FSDP 2 x
// TP 2 on 8 ranks, ZBVZeroBubble and DualPipeV x FSDP 2, Interleaved1F1B x CP 2 (FSDP over
// dp_shard x cp), HSDP 2 x 2 inside Interleaved1F1B; and InterleavedZeroBubble x FSDP 2 (LoopedBFS
// runs the same actions as Interleaved1F1B in another order). The measured differences are printed.
TEST(TrainerPP, FsdpInsideMultiStageSchedulesTrainsLikeTheSingleProcess) {
  const std::string shard2 = " --parallelism.data_parallel_shard_degree=2";
  constexpr int kScheduleSteps = 20;
  expect_pp_layouts_match_single_process(
      "", {
              {"pp2_Interleaved1F1B_x_fsdp2_x_tp2", 8, 4,
               pp(2, "Interleaved1F1B", 1) + shard2 + " --parallelism.tensor_parallel_degree=2"},
              {"pp2_ZBVZeroBubble_x_fsdp2", 4, 4, pp(2, "ZBVZeroBubble", 1) + shard2},
              {"pp2_DualPipeV_x_fsdp2", 4, 4, pp(2, "DualPipeV", 1) + shard2},
              {"pp2_Interleaved1F1B_x_cp2", 4, 8, pp(2, "Interleaved1F1B", 2) + " --parallelism.context_parallel_degree=2"},
              {"pp2_Interleaved1F1B_x_hsdp_2x2", 8, 2,
               pp(2, "Interleaved1F1B", 1) + shard2 + " --parallelism.data_parallel_replicate_degree=2"},
              {"pp2_InterleavedZeroBubble_x_fsdp2", 4, 4, pp(2, "InterleavedZeroBubble", 1) + shard2},
          },
      1e-5, kScheduleSteps);
  // Re-gathering a stage for every micro-batch cannot serve a split backward (W would find the
  // parameters freed by a later forward): one line, exit 2, before any step.
  TempDir dir("fsdp_zbv_always");
  RunResult r = run(loom_command(4, layout_train_args(dir, 2, 4, "--parallelism.data_parallel_shard_degree=1 " +
                                                                    pp(2, "ZBVZeroBubble", 1) + shard2 +
                                                                    " --parallelism.fsdp_reshard_after_forward=always")),
                    120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("splits the backward into input and weight passes"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[step "), std::string::npos) << r.output;
}

// TorchTitan's 405B 3-D recipe scaled down (issue 28): configs/llama3_405b_3d_debug.toml (PP 2
// Interleaved1F1B x FSDP 2 x TP 2 on 8 ranks, Float8, full AC) on the tiny model trains end to end
// and checkpoints; its checkpoint loads into plain FSDP (2 ranks), whose re-save loads back into
// the 3-D layout, all three bitwise equal; the 3-D layout resumed from the round-tripped
// checkpoint trains on exactly as the uninterrupted run did.
TEST(TrainerPP, Llama405BThreeDimensionalRecipeRunsAndReshardsThroughPlainFsdp) {
  const std::string config = loom::testing::source_path("configs/llama3_405b_3d_debug.toml");
  auto args = [&](const TempDir& dir, int steps, const std::string& extra) {
    return " train --config " + config + loom::testing::kTinyModel + " --model.tokenizer_path=" +
           loom::testing::source_path("data/default/tokenizer.json") + " --training.dataset_path=" +
           loom::testing::source_path("data/default/corpus.jsonl") + " --job.dump_folder=" + dir.str() +
           " --training.seq_len=64 --training.local_batch_size=4 --parallelism.pipeline_parallel_microbatch_size=1"
           " --training.deterministic=true --lr_scheduler.warmup_steps=2 --metrics.log_freq=1"
           " --checkpoint.interval=4 --checkpoint.keep_latest_k=0 --training.steps=" + std::to_string(steps) + extra;
  };
  TempDir recipe("recipe_405b");
  RunResult a = run(loom_command(8, args(recipe, 6, "")), 600);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("TP 2 (sequence parallel) + FSDP over 2 ranks"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("x PP 2 (Interleaved1F1B, 4 micro-batches of 1 rows, 2 stages per rank)"), std::string::npos)
      << a.output;
  EXPECT_NE(a.output.find("linears to float8 (rowwise)"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("activation checkpointing: full"), std::string::npos) << a.output;
  const fs::path step4 = recipe.path() / "checkpoint" / "step-4";
  ASSERT_TRUE(fs::exists(step4 / "metadata.json")) << a.output;

  // To plain FSDP over 2 ranks (the resave worker loads a layout's checkpoint and saves it again).
  TempDir fsdp_dir("fsdp_from_405b"), back_dir("405b_from_fsdp");
  const fs::path from_fsdp = loom::testing::resave_checkpoint(fsdp_dir, step4, 4, 2, " --checkpoint.enable=true");
  // And back into the 3-D layout.
  fs::create_directories(back_dir.path() / "checkpoint");
  fs::copy(from_fsdp, back_dir.path() / "checkpoint" / "step-4", fs::copy_options::recursive);
  const std::string back_args = args(back_dir, 6, "");
  RunResult b = run(bin_dir() + "/loom launch --nproc 8 --exec -- " + bin_dir() + "/loom_resave_worker " +
                        (back_dir.path() / "resaved").string() + " " + back_args.substr(back_args.find("--config")),
                    300);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  const fs::path round_trip = back_dir.path() / "resaved" / "step-4";
  const auto original = read_whole_checkpoint(step4);
  expect_bitwise_equal_checkpoints(original, read_whole_checkpoint(from_fsdp));
  expect_bitwise_equal_checkpoints(original, read_whole_checkpoint(round_trip));
  std::printf("405B 3-D layout -> FSDP 2 -> 405B 3-D layout: %zu tensors bitwise equal\n", original.size());

  // The 3-D layout resumes from the round trip and trains steps 5-6 as the uninterrupted run did.
  TempDir resumed("405b_resumed");
  fs::create_directories(resumed.path() / "checkpoint");
  fs::copy(round_trip, resumed.path() / "checkpoint" / "step-4", fs::copy_options::recursive);
  RunResult c = run(loom_command(8, args(resumed, 6, "")), 600);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("resumed from"), std::string::npos) << c.output;
  const auto whole = loom::testing::logged_losses(recipe.path()), tail = loom::testing::logged_losses(resumed.path());
  ASSERT_EQ(whole.size(), 6u);
  ASSERT_EQ(tail.size(), 2u);
  EXPECT_EQ(tail, std::vector<double>(whole.begin() + 4, whole.end()));
}

// Context parallelism inside the stages (issue 12's composition with PP): each micro-batch carries
// its chunks' positions (and document ids) to every stage, each stage's attention runs over the cp
// group, and FSDP shards each stage over dp_shard x cp. CP 2 x PP 2 with the ring and all-gather
// rotations, causal and block-causal, within 1e-4 (ring attention's log-sum-exp merge and FSDP's
// reduce-scatter reorder the additions; the measured figures are printed).
TEST(TrainerPP, ContextParallelStagesTrainLikeTheSingleProcess) {
  const std::string cp2 = " --parallelism.context_parallel_degree=2";
  expect_pp_layouts_match_single_process(
      "", {
              {"cp2_x_pp2_1F1B_m4_allgather", 4, 8, pp(2, "1F1B", 2) + cp2},
              {"cp2_x_pp2_GPipe_m4_ring", 4, 8, pp(2, "GPipe", 2) + cp2 + " --parallelism.context_parallel_rotate_method=ring"},
          },
      1e-4);
  expect_pp_layouts_match_single_process(
      " --model.attention_mask=block_causal",
      {{"block_causal_cp2_x_pp2_1F1B_m4_ring", 4, 8, pp(2, "1F1B", 2) + cp2 + " --parallelism.context_parallel_rotate_method=ring"}},
      1e-4);
}

// Issue 12's 4-D layout: PP 2 x FSDP 2 x CP 2 x TP 2 on 16 ranks (mesh pp x dp_shard x cp x tp),
// 8 steps, within 1e-4 of the single process.
TEST(TrainerPP, FourDimensionsOnSixteenRanksTrainLikeTheSingleProcess) {
  expect_pp_layouts_match_single_process(
      "", {{"pp2_x_fsdp2_x_cp2_x_tp2_1F1B_m4", 16, 4,
            pp(2, "1F1B", 1) + " --parallelism.data_parallel_shard_degree=2 --parallelism.context_parallel_degree=2"
                               " --parallelism.tensor_parallel_degree=2"}},
      1e-4, 8);
}

// A PP 2 checkpoint (each rank saved its stage) loads in one process, which saves it again; that
// loads at PP 4, which saves it again. All three hold the same parameters, AdamW moments and step
// counts, bitwise. Then PP 4 resumes from it and trains on.
TEST(TrainerPP, CheckpointMovesFromPp2ToOneProcessToPp4Bitwise) {
  TempDir source("pp2"), single("single"), pp4("pp4");
  const std::string ckpt = " --checkpoint.enable=true --checkpoint.interval=6 --checkpoint.keep_latest_k=0";
  RunResult a = run(loom_command(2, layout_train_args(source, 6, 8, ckpt + " --parallelism.data_parallel_shard_degree=1 " +
                                                                        pp(2, "1F1B", 2))),
                    600);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const fs::path step6 = source.path() / "checkpoint" / "step-6";
  ASSERT_TRUE(fs::exists(step6 / "metadata.json")) << a.output;

  // Load in a layout and save again, untrained: `loom_resave_worker OUT -- <train args>`.
  auto resave = [&](const TempDir& run_dir, const fs::path& from, int nproc, const std::string& flags) {
    fs::create_directories(run_dir.path() / "checkpoint");
    fs::copy(from, run_dir.path() / "checkpoint" / "step-6", fs::copy_options::recursive);
    const std::string args = layout_train_args(run_dir, 12, 8, ckpt + " --parallelism.data_parallel_shard_degree=1 " + flags);
    // layout_train_args begins with " train --config FILE": the worker takes what follows "train".
    const std::string worker_args = args.substr(args.find("--config"));
    RunResult r = run(bin_dir() + "/loom launch --nproc " + std::to_string(nproc) + " --exec -- " + bin_dir() +
                          "/loom_resave_worker " + (run_dir.path() / "resaved").string() + " " + worker_args,
                      300);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return run_dir.path() / "resaved" / "step-6";
  };
  const fs::path from_single = resave(single, step6, 1, "");
  const fs::path from_pp4 = resave(pp4, from_single, 4, pp(4, "1F1B", 2));

  const auto original = read_whole_checkpoint(step6);
  size_t moments = 0;
  expect_bitwise_equal_checkpoints(original, read_whole_checkpoint(from_single));
  expect_bitwise_equal_checkpoints(original, read_whole_checkpoint(from_pp4));
  for (const auto& [name, t] : original) moments += name.find("exp_avg") != std::string::npos;
  EXPECT_GT(moments, 0u);  // optimizer state was compared, not only parameters
  std::printf("PP 2 -> one process -> PP 4: %zu tensors (parameters, AdamW moments, step counts) bitwise equal\n",
              original.size());

  // PP 4 resumes from the round-tripped checkpoint and trains on like PP 2 would (same losses
  // within float32 rounding: the batches and state are the same).
  TempDir pp2_on("pp2_on"), pp4_on("pp4_on");
  for (const auto& [dir, nproc, flags] : {std::tuple{&pp2_on, 2, pp(2, "1F1B", 2)}, std::tuple{&pp4_on, 4, pp(4, "1F1B", 2)}}) {
    fs::create_directories(dir->path() / "checkpoint");
    fs::copy(nproc == 2 ? step6 : from_pp4, dir->path() / "checkpoint" / "step-6", fs::copy_options::recursive);
    RunResult r = run(loom_command(nproc, layout_train_args(*dir, 10, 8, ckpt + " --parallelism.data_parallel_shard_degree=1 " + flags)), 600);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  }
  const auto l2 = loom::testing::logged_losses(pp2_on.path()), l4 = loom::testing::logged_losses(pp4_on.path());
  ASSERT_EQ(l2.size(), 4u);
  ASSERT_EQ(l4.size(), 4u);
  EXPECT_LE(worst_relative(l2, l4), 1e-5);
}

// Bad pipeline settings: one line on every rank, exit 2, before any training.
TEST(TrainerPP, BadPipelineSettingsAreOneLine) {
  TempDir dir("bad");
  const fs::path csv = dir.path() / "deadlock.csv";
  // Rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's activations, which
  // rank 1 wants first.
  std::ofstream(csv) << "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n";
  struct Case {
    std::string flags;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {pp(2, "1f1b_interleaved", 2), "did you mean"},
      {pp(2, "1F1B", 8), "1F1B"},  // 1 micro-batch for 2 ranks
      {pp(2, "1F1B", 3), "does not divide training.local_batch_size = 8"},
      {pp(2, "1F1B", 2) + " --parallelism.pipeline_parallel_layers_per_stage=4",
       "parallelism.pipeline_parallel_layers_per_stage = 4"},
      {pp(2, "1F1B", 4) + " --parallelism.pipeline_parallel_schedule_csv=" + csv.string(), "schedule deadlocks"},
  };
  for (const Case& c : cases) {
    RunResult r = run(loom_command(2, layout_train_args(dir, 2, 8, "--parallelism.data_parallel_shard_degree=1 " + c.flags)), 120);
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.flags << "\n" << r.output;
    EXPECT_EQ(r.output.find("[step "), std::string::npos) << r.output;
    const size_t at = r.output.find("error:");
    std::printf("%s\n  -> %s\n", c.flags.c_str(),
                at == std::string::npos ? "(no error line)" : r.output.substr(at, r.output.find('\n', at) - at).c_str());
  }
}
