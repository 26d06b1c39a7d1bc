// Parallel layouts on CUDA tensors with two ranks sharing one GPU (issue 49 item 4):
// comm.device_transport = "host" stages every collective on device tensors through host memory and
// the CPU transport (NCCL refuses two ranks on one device), so FSDP 2, TP 2, PP 2 and EP 2 run
// their device-side code paths (CUDA parameters, gradients, streams) against the one-process CUDA
// run on a machine with one GPU. Same harness and tolerances as the CPU layout tests
// (layout_runs.h: the tiny models, seq 64, every step's loss and gradient norm within 1e-5 relative,
// clipping engaged on at least half the reference's steps), fp32 without TF32. Without a CUDA device
// each test skips ("skipped: no CUDA device"); NCCL stays the production path.
#include <gtest/gtest.h>

#include <torch/cuda.h>

#include "loom/train/tests/layout_runs.h"

namespace {
using loom::testing::Layout;

#define LOOM_REQUIRE_CUDA_DEVICE()                                                 \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device"

// Reference and layouts alike: on the GPU, fp32, no TF32 (the layouts sum in another order; TF32
// would round those sums differently by far more than 1e-5).
const std::string kOnTheGpu =
    " --training.device=cuda --training.allow_tf32=false --training.mixed_precision_param=float32"
    " --training.mixed_precision_reduce=float32";
const std::string kSharedDevice = " --comm.device_transport=host";

struct SharedDeviceCase {
  Layout layout;
  std::string model;  // model flags (reference and layout)
};

void PrintTo(const SharedDeviceCase& c, std::ostream* os) { loom::testing::PrintTo(c.layout, os); }

class CudaSharedDevice : public ::testing::TestWithParam<SharedDeviceCase> {};

TEST_P(CudaSharedDevice, TrainsLikeTheSingleProcessOnTheGpu) {
  LOOM_REQUIRE_CUDA_DEVICE();
  const SharedDeviceCase& c = GetParam();
  Layout l = c.layout;
  l.flags += kSharedDevice;
  loom::testing::expect_layout_matches_single_process(l, kOnTheGpu + c.model, 4,
                                                      loom::testing::Tolerance{1e-5, -1, 1e-5});
}

INSTANTIATE_TEST_SUITE_P(
    TwoRanksOneGpu, CudaSharedDevice,
    ::testing::Values(
        SharedDeviceCase{Layout{"fsdp2", 2, 4, "--parallelism.data_parallel_shard_degree=2"}, ""},
        SharedDeviceCase{Layout{"tp2", 2, 8,
                                "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
                         ""},
        SharedDeviceCase{Layout{"pp2_1F1B", 2, 8,
                                "--parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_schedule=1F1B"
                                " --parallelism.pipeline_parallel_microbatch_size=1"
                                " --parallelism.data_parallel_shard_degree=1"},
                         ""},
        SharedDeviceCase{Layout{"ep2", 2, 4, "--parallelism.expert_parallel_degree=2"}, " --model.name=qwen3_moe"}),
    [](const ::testing::TestParamInfo<SharedDeviceCase>& info) { return std::string(info.param.layout.name); });

}  // namespace
