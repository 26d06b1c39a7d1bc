// Training and checkpoints on a CUDA device (label "cuda"), through the `loom` binary: issue 9's
// acceptance checks. Where no CUDA device is visible every test skips with "skipped: no CUDA
// device" (the one skip the project allows), so the CPU suite passes unchanged; on a GPU machine
// `ctest -L cuda` runs them.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include <torch/cuda.h>

#include "loom/core/build_paths.h"
#include "loom/models/common/model_dir.h"
#include "loom/models/llama3/model.h"
#include "loom/testing/run.h"

namespace {
using loom::testing::loom_bin;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

#define LOOM_REQUIRE_CUDA_DEVICE()                                                 \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device"

using loom::testing::source_path;

// The debug model, one process, seq 64, every step logged.
std::string train_args(const TempDir& dir, const std::string& device, int steps,
                       const std::string& config = "configs/llama3_debug.toml") {
  return " train --config " + source_path(config) + " --validation.enable=false" +
         " --model.tokenizer_path=" + source_path("data/default/tokenizer.json") +
         " --training.dataset_path=" + source_path("data/default/corpus.jsonl") +
         " --job.dump_folder=" + dir.str() + " --training.seq_len=64 --training.local_batch_size=8" +
         " --training.steps=" + std::to_string(steps) + " --training.device=" + device +
         " --lr_scheduler.warmup_steps=2 --metrics.log_freq=1 --metrics.peak_flops=1e11" +
         " --parallelism.data_parallel_shard_degree=1";
}

using loom::testing::losses;

}  // namespace

// 30 steps of the debug model in fp32 on the GPU follow the CPU run: 1e-4 relative at step 1 (same
// weights, same batch; only the kernels' summation order differs), 1e-3 after (the differences
// grow through the updates), and the loss falls.
TEST(Cuda, DebugModelOnTheGpuMatchesTheCpu) {
  LOOM_REQUIRE_CUDA_DEVICE();
  TempDir cpu("cpu"), gpu("gpu");
  RunResult a = run(loom_bin() + train_args(cpu, "cpu", 30), 600);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  RunResult b = run(loom_bin() + train_args(gpu, "cuda", 30), 600);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("device: cuda:0"), std::string::npos) << b.output;
  const auto la = losses(cpu), lb = losses(gpu);
  ASSERT_EQ(la.size(), 30u);
  ASSERT_EQ(lb.size(), 30u);
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    const double rel = std::abs(la[i] - lb[i]) / std::abs(la[i]);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, i == 0 ? 1e-4 : 1e-3) << "step " << i + 1 << ": cpu " << la[i] << " vs cuda " << lb[i];
  }
  EXPECT_LT(lb.back(), lb.front());
  std::printf("cuda vs cpu fp32, 30 steps: max relative loss difference %.3g; cuda loss %.4f -> %.4f\n",
              worst, lb.front(), lb.back());
}

// The MoE families on the GPU (the Qwen3-MoE, DeepSeek-V3 and GPT-OSS debug models: router,
// experts, the balancing rule; MLA for DeepSeek-V3; sinks, sliding windows, biased router and
// experts and the clamped SwiGLU for GPT-OSS): 20 fp32 steps follow the CPU run (1e-4 relative at
// step 1; 5e-3 after, looser than the dense model's 1e-3 because a near-tie in the top-k
// selection may route a token differently once the weights have drifted by the kernels'
// rounding), and bf16 autocast trains to within 2 % of the fp32 GPU run's final loss.
TEST(Cuda, MoEModelsOnTheGpuMatchTheCpu) {
  LOOM_REQUIRE_CUDA_DEVICE();
  for (const std::string config :
       {"configs/qwen3_moe_debug.toml", "configs/deepseek_v3_debug.toml", "configs/gpt_oss_debug.toml"}) {
    TempDir cpu("cpu"), gpu("gpu"), bf16("bf16");
    const std::string lr = " --optimizer.lr=1e-3";
    RunResult a = run(loom_bin() + train_args(cpu, "cpu", 20, config) + lr, 600);
    ASSERT_EQ(a.exit_code, 0) << config << "\n" << a.output;
    RunResult b = run(loom_bin() + train_args(gpu, "cuda", 20, config) + lr, 600);
    ASSERT_EQ(b.exit_code, 0) << config << "\n" << b.output;
    RunResult c = run(loom_bin() + train_args(bf16, "cuda", 20, config) + lr +
                          " --training.mixed_precision_param=bfloat16", 600);
    ASSERT_EQ(c.exit_code, 0) << config << "\n" << c.output;
    const auto la = losses(cpu), lb = losses(gpu), lc = losses(bf16);
    ASSERT_EQ(la.size(), 20u) << config;
    ASSERT_EQ(lb.size(), 20u) << config;
    ASSERT_EQ(lc.size(), 20u) << config;
    double worst = 0;
    for (size_t i = 0; i < la.size(); ++i) {
      const double rel = std::abs(la[i] - lb[i]) / std::abs(la[i]);
      worst = std::max(worst, rel);
      EXPECT_LE(rel, i == 0 ? 1e-4 : 1e-3) << config << " step " << i + 1 << ": cpu " << la[i]
                                           << " vs cuda " << lb[i];
    }
    EXPECT_LT(lb.back(), lb.front()) << config;
    const double bf16_rel = std::abs(lc.back() - lb.back()) / lb.back();
    EXPECT_LE(bf16_rel, 0.02) << config << ": bf16 " << lc.back() << " vs fp32 " << lb.back();
    std::printf("%s: cuda vs cpu fp32, 20 steps: max relative loss difference %.3g; bf16 final %.4f vs "
                "fp32 %.4f\n", config.c_str(), worst, lc.back(), lb.back());
  }
}

// bf16 autocast on the GPU (no FSDP: TorchTitan's AMP path) tracks the fp32 GPU run.
TEST(Cuda, Bf16AutocastTracksFloat32) {
  LOOM_REQUIRE_CUDA_DEVICE();
  TempDir fp32("fp32"), bf16("bf16");
  RunResult a = run(loom_bin() + train_args(fp32, "cuda", 30), 600);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  RunResult b = run(loom_bin() + train_args(bf16, "cuda", 30) + " --training.mixed_precision_param=bfloat16", 600);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  const auto la = losses(fp32), lb = losses(bf16);
  ASSERT_EQ(la.size(), 30u);
  ASSERT_EQ(lb.size(), 30u);
  EXPECT_NE(la, lb) << "bf16 autocast left the losses bitwise fp32: it is not active";
  const double final_rel = std::abs(lb.back() - la.back()) / la.back();
  EXPECT_LE(final_rel, 0.02);
  std::printf("cuda bf16 autocast vs fp32: final loss %.4f vs %.4f (%.3g relative)\n", lb.back(),
              la.back(), final_rel);
}

// A checkpoint saved from the GPU loads on the CPU and goes back to the GPU with every weight
// bitwise unchanged (staging copies values; it never converts them).
TEST(Cuda, CheckpointMovesBetweenGpuAndCpuBitwise) {
  LOOM_REQUIRE_CUDA_DEVICE();
  TempDir run_dir("ckpt"), out("moved");
  RunResult r = run(loom_bin() + train_args(run_dir, "cuda", 4) +
                        " --checkpoint.enable=true --checkpoint.interval=4",
                    600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto saved = run_dir.path() / "checkpoint" / "step-4";
  const auto on_cpu = out.path() / "cpu", back_on_gpu = out.path() / "gpu";
  RunResult c = run(loom_bin() + " convert --to loom --device cpu --input " + saved.string() +
                    " --output " + on_cpu.string());
  ASSERT_EQ(c.exit_code, 0) << c.output;
  RunResult g = run(loom_bin() + " convert --to loom --device cuda --input " + on_cpu.string() +
                    " --output " + back_on_gpu.string());
  ASSERT_EQ(g.exit_code, 0) << g.output;
  // named_parameters() points into its model: each loaded model stays alive while it is compared.
  const auto original_model = loom::models::load_model_dir(saved).model;
  const auto via_cpu_model = loom::models::load_model_dir(on_cpu).model;
  const auto via_gpu_model = loom::models::load_model_dir(back_on_gpu).model;
  const auto original = original_model->named_parameters();
  const auto via_cpu = via_cpu_model->named_parameters();
  const auto via_gpu = via_gpu_model->named_parameters();
  ASSERT_EQ(original.size(), via_cpu.size());
  ASSERT_EQ(original.size(), via_gpu.size());
  for (size_t i = 0; i < original.size(); ++i) {
    EXPECT_TRUE(torch::equal(original[i].tensor(), via_cpu[i].tensor())) << original[i].name;
    EXPECT_TRUE(torch::equal(original[i].tensor(), via_gpu[i].tensor())) << original[i].name;
  }
}

// Resuming on the GPU from a checkpoint the GPU wrote continues where the run left off: the same
// losses as the uninterrupted run (cuBLAS and the kernels used are deterministic for fixed shapes
// on one device; a relative 1e-6 allows for none of that failing silently). The resumed run starts
// from a copy of the uninterrupted run's step-4 checkpoint with the same training.steps, so the
// learning-rate schedule is the same one.
TEST(Cuda, ResumeOnTheGpuContinuesTheRun) {
  LOOM_REQUIRE_CUDA_DEVICE();
  TempDir whole("whole"), resumed("resumed");
  const std::string ckpt = " --checkpoint.enable=true --checkpoint.interval=4";
  RunResult first = run(loom_bin() + train_args(whole, "cuda", 8) + ckpt, 600);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  std::filesystem::create_directories(resumed.path() / "checkpoint");
  std::filesystem::copy(whole.path() / "checkpoint" / "step-4", resumed.path() / "checkpoint" / "step-4",
                        std::filesystem::copy_options::recursive);
  RunResult second = run(loom_bin() + train_args(resumed, "cuda", 8) + ckpt, 600);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
  const auto a = losses(whole), b = losses(resumed);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(a[4 + i], b[i], 1e-6 * std::abs(a[4 + i])) << "step " << 5 + i;
}
