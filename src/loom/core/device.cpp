#include "loom/core/device.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include "loom/core/error.h"

namespace loom {

c10::Device select_device(const std::string& requested, int local_rank) {
  if (requested == "cpu") return c10::Device(c10::kCPU);
  const bool usable = torch::cuda::is_available();
  if (requested == "auto") {
    if (!usable) return c10::Device(c10::kCPU);
  } else {
    LOOM_REQUIRE_USAGE(requested == "cuda", "training.device must be \"auto\", \"cpu\" or \"cuda\", "
                       "got \"", requested, "\"");
    LOOM_REQUIRE_USAGE(at::detail::getCUDAHooks().isBuilt(),
                       "training.device = \"cuda\" but this Loom build's libtorch has no CUDA "
                       "support; build against a CUDA torch (README, \"On a GPU machine\") or set "
                       "training.device = \"cpu\"");
    LOOM_REQUIRE_USAGE(usable, "training.device = \"cuda\" but no CUDA device is visible (check "
                       "nvidia-smi and CUDA_VISIBLE_DEVICES); set training.device = \"cpu\" or "
                       "\"auto\"");
  }
  const int count = static_cast<int>(torch::cuda::device_count());
  LOOM_REQUIRE_USAGE(local_rank < count, "rank with LOCAL_RANK ", local_rank, " has no GPU of its "
                     "own: ", count, " visible on this node; start at most ", count,
                     " ranks per node (loom launch --nproc ", count, ")");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

void set_current_device(c10::Device device) {
  if (device.is_cpu()) return;
  LOOM_REQUIRE(device.has_index(), "set_current_device needs a device index, got ", device);
  c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
}

}  // namespace loom
