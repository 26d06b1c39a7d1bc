#include "loom/core/device.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#ifdef LOOM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif


#include "loom/core/error.h"

namespace loom {

const options::EnumNames<DeviceRequest>& option_names(DeviceRequest) {
  static const options::EnumNames<DeviceRequest> names = {
      {"auto", DeviceRequest::kAuto}, {"cpu", DeviceRequest::kCpu}, {"cuda", DeviceRequest::kCuda}};
  return names;
}

c10::Device select_device(const std::string& requested, int local_rank, const std::string& setting,
                          bool share_devices) {
  return select_device(options::parse_enum<DeviceRequest>(requested, setting), local_rank, setting, share_devices);
}

c10::Device select_device(DeviceRequest requested, int local_rank, const std::string& setting, bool share_devices) {
  // How the user writes a value of the setting: `training.device = "cpu"` or `--device cpu`.
  const bool flag = setting.rfind("--", 0) == 0;
  auto value = [&](const char* v) {
    return flag ? c10::str(setting, " ", v) : c10::str(setting, " = \"", v, "\"");
  };
  if (requested == DeviceRequest::kCpu) return c10::Device(c10::kCPU);
  const bool usable = torch::cuda::is_available();
  if (requested == DeviceRequest::kAuto) {
    if (!usable) return c10::Device(c10::kCPU);
  } else {
    LOOM_REQUIRE_USAGE(at::detail::getCUDAHooks().isBuilt(),
                       value("cuda"), " but this Loom build's libtorch has no CUDA support; build "
                       "against a CUDA torch (README, \"On a GPU machine\") or use ", value("cpu"));
    LOOM_REQUIRE_USAGE(usable, value("cuda"), " but no CUDA device is visible (check nvidia-smi and "
                       "CUDA_VISIBLE_DEVICES); use ", value("cpu"), " or ", value("auto"));
  }
  const int count = static_cast<int>(torch::cuda::device_count());
  if (share_devices) return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % count));
  LOOM_REQUIRE_USAGE(local_rank < count, "rank with LOCAL_RANK ", local_rank, " has no GPU of its "
                     "own: ", count, " visible on this node; start at most ", count,
                     " ranks per node (loom launch --nproc ", count, "), or share GPUs with "
                     "comm.device_transport = \"host\" (tests only: slow)");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

std::optional<double> peak_bf16_flops_by_name(const std::string& name) {
  auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  // Most specific first: "H200" contains "H20", "H100 NVL" contains "H100".
  if (has("H200")) return 989e12;  // SXM; same tensor cores as the H100 SXM
  if (has("H100")) {
    if (has("NVL")) return 835e12;
    if (has("PCIe")) return 756e12;
    return 989e12;  // SXM (HBM3)
  }
  if (has("H20")) return 148e12;
  if (has("GB200") || has("B200")) return 2250e12;
  if (has("A100")) return 312e12;
  if (has("A800")) return 312e12;
  if (has("L40S")) return 362e12;
  if (has("L4")) return 121e12;
  if (has("A10G")) return 70e12;  // AWS's A10G: 70 TFLOP/s dense bf16
  if (has("A10")) return 125e12;
  return std::nullopt;
}

DeviceInfo device_info(c10::Device device) {
  DeviceInfo info;
  if (device.is_cpu()) {
    info.name = "cpu";
    return info;
  }
  info.total_memory_bytes = static_cast<int64_t>(at::accelerator::getMemoryInfo(device.index()).second);
#ifdef LOOM_WITH_CUDA
  if (device.is_cuda()) info.name = at::cuda::getDeviceProperties(device.index())->name;
#endif
  if (info.name.empty()) info.name = device.str();
  info.peak_bf16_flops = peak_bf16_flops_by_name(info.name);
  return info;
}

void synchronize(c10::Device device) {
  if (device.is_cpu()) return;
  at::accelerator::synchronizeDevice(device.index());
}

void set_current_device(c10::Device device) {
  if (device.is_cpu()) return;
  LOOM_REQUIRE(device.has_index(), "set_current_device needs a device index, got ", device);
  c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
}

}  // namespace loom
