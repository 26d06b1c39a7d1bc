// The CUDA suite (label "cuda"): NCCL process groups, device-resident FSDP, pinned checkpoint
// staging, and multi-rank training on CUDA through the `loom` binary. Built on every machine; where
// no CUDA device is usable every test skips with "skipped: no CUDA device" (the only skip), and the
// 2-rank run skips with "skipped: needs 2 CUDA devices" on a machine with one GPU.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <cmath>
#include <filesystem>

#include "loom/testing/tiny_llama.h"
#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/saver.h"
#include "loom/core/build_paths.h"
#include "loom/core/device.h"
#include "loom/distributed/process_group.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/fsdp/sharded_optimizer.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/spec.h"
#include "loom/optim/adamw.h"
#include "loom/optim/optimizer.h"
#include "loom/testing/checkpoint_files.h"
#include "loom/testing/run.h"

namespace {
namespace fs = std::filesystem;
using loom::testing::bin_dir;
using loom::testing::read_jsonl;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

#define LOOM_REQUIRE_CUDA()                                                        \
  do {                                                                             \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";   \
  } while (0)

const c10::Device kGpu(c10::kCUDA, 0);

// ---------------------------------------------------------------------------------------------
// NCCL groups

// A one-rank NCCL group is a real communicator (the comm layer short-circuits one-rank groups, so
// this drives the backend directly): each collective runs on the device and leaves the identity.
TEST(CudaNccl, WorldSizeOneGroupRunsCollectivesOnTheDevice) {
  LOOM_REQUIRE_CUDA();
  loom::set_current_device(kGpu);
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto nccl = loom::distributed::new_nccl_backend(store, 0, 1, std::chrono::seconds(60), kGpu, {0});
  EXPECT_EQ(nccl->getBackendName(), "nccl");
  ASSERT_TRUE(nccl->getBoundDeviceId().has_value());
  EXPECT_EQ(*nccl->getBoundDeviceId(), kGpu);

  const torch::Tensor expected = torch::arange(12, torch::TensorOptions().dtype(torch::kFloat32).device(kGpu));
  std::vector<at::Tensor> reduced{expected.clone()};
  nccl->allreduce(reduced)->wait();
  torch::Tensor input = expected.clone();  // c10d takes the input by non-const reference
  torch::Tensor gathered = torch::empty({12}, expected.options());
  nccl->_allgather_base(gathered, input)->wait();
  torch::Tensor scattered = torch::empty({12}, expected.options());
  nccl->_reduce_scatter_base(scattered, input)->wait();
  std::vector<at::Tensor> broadcast{expected.clone()};
  nccl->broadcast(broadcast)->wait();
  torch::cuda::synchronize();
  for (const auto& [name, t] : {std::pair{"all_reduce", reduced[0]}, {"all_gather", gathered},
                                {"reduce_scatter", scattered}, {"broadcast", broadcast[0]}}) {
    EXPECT_TRUE(t.is_cuda()) << name;
    EXPECT_TRUE(torch::equal(t.cpu(), expected.cpu())) << name;
  }
  nccl->shutdown();
}

// The trainer's path for a CUDA rank: the world knows its device and picks NCCL for it (a world of
// one rank creates no backend at all; its collectives are local on any device).
TEST(CudaNccl, CudaWorldPicksNcclAndRunsLocalCollectivesOnTheDevice) {
  LOOM_REQUIRE_CUDA();
  auto dist = loom::distributed::init_distributed(loom::distributed::LaunchEnv{}, std::chrono::seconds(30), kGpu);
  EXPECT_EQ(dist->device(), kGpu);
  EXPECT_EQ(dist->device_backend_kind(), loom::distributed::BackendKind::kNccl);
  torch::Tensor t = torch::ones({4}, torch::TensorOptions().device(kGpu));
  dist->world()->all_reduce(t, loom::distributed::ReduceOp::kAvg);
  EXPECT_TRUE(torch::equal(t.cpu(), torch::ones({4})));
  dist->shutdown();
}

// ---------------------------------------------------------------------------------------------
// Device-resident FSDP on one rank

loom::llama3::ModelArgs tiny_args() { return loom::testing::tiny_llama_args(); }

// FSDP with policy.device = cuda:0 keeps every flat buffer, gradient and optimizer state on the
// GPU and trains like the unwrapped model on the same GPU.
TEST(CudaFsdp, DeviceResidentOneRankFsdpTrainsLikeTheUnwrappedModel) {
  LOOM_REQUIRE_CUDA();
  loom::set_current_device(kGpu);
  using namespace loom;
  auto reference = std::make_shared<llama3::Transformer>(tiny_args());
  reference->init_weights(5);
  reference->to(kGpu);
  auto model = std::make_shared<llama3::Transformer>(tiny_args(),
                                                     torch::TensorOptions().device(torch::kMeta));
  fsdp::FSDPPolicy policy;
  policy.device = kGpu;
  auto sharded = models::apply_fsdp(*model, fsdp::FSDPMesh::single(), policy);
  models::init_sharded_weights(*model, *sharded, 5, kGpu);
  for (fsdp::FSDPParamGroup* g : sharded->param_groups()) {
    EXPECT_EQ(g->sharded_params().device(), kGpu) << g->name();
    EXPECT_EQ(g->sharded_grads().device(), kGpu) << g->name();
  }
  for (const auto& b : model->named_buffers()) EXPECT_EQ(b.slot->tensor.device(), kGpu) << b.name;

  optim::AdamWOptions options;
  options.lr = 1e-3;
  fsdp::ShardedAdamW optimizer(sharded, options, 0.1);
  optim::NamedTensors named;
  for (const auto& p : reference->named_parameters()) named.emplace_back(p.name, p.tensor());
  optim::AdamW ref_optimizer(optim::weight_decay_param_groups(named, 0.1), options);
  for (const auto& s : optimizer.sharded_state_dict()) EXPECT_EQ(s.local.device(), kGpu) << s.name;

  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  for (int step = 0; step < 3; ++step) {
    const torch::Tensor tokens = torch::randint(0, 128, {2, 9}, gen).to(kGpu);
    const torch::Tensor inputs = tokens.narrow(1, 0, 8), labels = tokens.narrow(1, 1, 8);
    optimizer.zero_grad();
    ref_optimizer.zero_grad();
    const torch::Tensor loss = model->forward_loss(inputs, labels);
    const torch::Tensor ref_loss = reference->forward_loss(inputs, labels);
    loss.backward();
    ref_loss.backward();
    optimizer.step();
    ref_optimizer.step();
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5 * std::abs(ref_loss.item<double>()))
        << "step " << step;
  }
  const auto full = sharded->full_state_dict();
  for (const auto& p : reference->named_parameters()) {
    EXPECT_TRUE(torch::allclose(full.at(p.name), p.tensor(), 1e-5, 1e-6)) << p.name;
  }
}

// ---------------------------------------------------------------------------------------------
// Checkpoint staging through pinned memory

// An async save of GPU tensors (pinned host copies, one event) writes byte for byte what a save of
// their host copies writes, holds the values of the moment it started even when the GPU tensors
// change right after wait_staged(), reuses its pinned buffers on the next save, and loads back into
// GPU tensors.
TEST(CudaCheckpoint, AsyncSaveStagesDeviceTensorsThroughPinnedMemory) {
  LOOM_REQUIRE_CUDA();
  using namespace loom::checkpoint;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const torch::Tensor w = torch::randn({64, 33}, gen);
  const torch::Tensor b = torch::randn({1000}, gen).to(torch::kBFloat16);
  TempDir host_dir("ckpt-host"), device_dir("ckpt-cuda");
  ShardedSaver saver(single_process_group());
  for (int64_t step = 1; step <= 2; ++step) {
    ShardedStateDict host;
    host.add_full("w", kModelComponent, w + static_cast<double>(step));
    host.add_full("b", kModelComponent, b);
    saver.save(host, host_dir.path(), step);
    const torch::Tensor dw = (w + static_cast<double>(step)).to(kGpu), db = b.to(kGpu);
    ShardedStateDict device;
    device.add_full("w", kModelComponent, dw);
    device.add_full("b", kModelComponent, db);
    saver.begin_async_save(device, device_dir.path(), step);
    saver.wait_staged();
    dw.add_(100.0);  // the optimizer step that follows: must not reach the checkpoint
    saver.wait();
    loom::testing::expect_identical_checkpoint_files(
        host_dir.path() / step_dir_name(step), device_dir.path() / step_dir_name(step),
        {"rank-0.safetensors", "metadata.json", "COMPLETE"});
  }
  ShardedStateDict dest;
  const torch::Tensor lw = torch::zeros({64, 33}, torch::TensorOptions().device(kGpu));
  const torch::Tensor lb = torch::zeros({1000}, torch::TensorOptions().dtype(torch::kBFloat16).device(kGpu));
  dest.add_full("w", kModelComponent, lw);
  dest.add_full("b", kModelComponent, lb);
  load_checkpoint(device_dir.path() / step_dir_name(2), dest);
  EXPECT_TRUE(lw.is_cuda());
  EXPECT_TRUE(torch::equal(lw.cpu(), w + 2.0));
  EXPECT_TRUE(torch::equal(lb.cpu(), b));
}

// ---------------------------------------------------------------------------------------------
// Multi-rank training on CUDA through the binary

using loom::testing::source_path;

std::string train_args(const TempDir& dir, int local_batch, int steps) {
  return " train --config " + source_path("configs/llama3_debug.toml") + " --validation.enable=false" +
         " --model.tokenizer_path=" + source_path("data/default/tokenizer.json") +
         " --training.dataset_path=" + source_path("data/default/corpus.jsonl") +
         " --job.dump_folder=" + dir.str() + " --training.seq_len=64 --training.steps=" +
         std::to_string(steps) + " --training.local_batch_size=" + std::to_string(local_batch) +
         " --lr_scheduler.warmup_steps=2 --metrics.log_freq=1 --training.device=cuda";
}

using loom::testing::losses;

// FSDP over 2 GPUs (NCCL all-gathers and reduce-scatters on device buffers, async checkpoints
// staged through pinned memory) follows the one-GPU run with the same global batch, and resuming
// from its step-5 checkpoint (loaded onto the devices) continues the uninterrupted run.
TEST(CudaTrain, TwoRankFsdpOnCudaFollowsOneRankAndResumes) {
  LOOM_REQUIRE_CUDA();
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "skipped: needs 2 CUDA devices";
  TempDir single("cuda1"), fsdp("cuda-fsdp"), resumed("cuda-resumed");
  const RunResult a = run(bin_dir() + "/loom" + train_args(single, 8, 10) +
                              " --parallelism.data_parallel_shard_degree=1",
                          300);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::string launch = bin_dir() + "/loom launch --nproc 2 -- ";
  const std::string sharded = " --parallelism.data_parallel_shard_degree=-1 --checkpoint.enable=true"
                              " --checkpoint.interval=5 --checkpoint.async_mode=async";
  const RunResult b = run(launch + train_args(fsdp, 4, 10) + sharded, 300);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  const auto la = losses(single), lb = losses(fsdp);
  ASSERT_EQ(la.size(), 10u);
  ASSERT_EQ(lb.size(), 10u);
  for (size_t i = 0; i < la.size(); ++i) {
    EXPECT_LE(std::abs(la[i] - lb[i]) / std::abs(la[i]), 1e-4)
        << "step " << i + 1 << ": one GPU " << la[i] << " vs FSDP on 2 GPUs " << lb[i];
  }
  EXPECT_LT(lb.back(), lb.front());

  fs::create_directories(resumed.path() / "checkpoint");
  fs::copy(fsdp.path() / "checkpoint" / "step-5", resumed.path() / "checkpoint" / "step-5",
           fs::copy_options::recursive);
  const RunResult c = run(launch + train_args(resumed, 4, 10) + sharded, 300);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("resumed from"), std::string::npos) << c.output;
  const auto lc = losses(resumed);
  ASSERT_EQ(lc.size(), 5u);
  for (size_t i = 0; i < lc.size(); ++i) {
    EXPECT_LE(std::abs(lb[5 + i] - lc[i]) / std::abs(lb[5 + i]), 1e-5) << "step " << 6 + i;
  }
}

}  // namespace
