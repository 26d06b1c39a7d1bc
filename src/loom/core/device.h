// The one device a rank computes on, chosen once (training.device) and passed down: the model is
// materialized there and every batch is moved there. "auto" means the rank's GPU when CUDA is
// usable (cuda:LOCAL_RANK), else the CPU.
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

#include "loom/core/options.h"

namespace loom {

// training.device (and the model commands' --device): "auto" | "cpu" | "cuda".
enum class DeviceRequest { kAuto, kCpu, kCuda };
const options::EnumNames<DeviceRequest>& option_names(DeviceRequest);

// loom::UsageError (exit 2, one line) when CUDA is asked
// for but this libtorch has no CUDA support, or no CUDA device is visible, or the rank's local
// index has no GPU of its own. `setting` names where the choice came from in those messages (a
// config key, or a command-line flag such as "--device").
// `share_devices`: ranks may share a GPU (their collectives do not use NCCL: comm.device_transport
// = "host"): local rank r computes on GPU r mod the visible count.
c10::Device select_device(DeviceRequest requested, int local_rank,
                          const std::string& setting = "training.device", bool share_devices = false);
// The same for a name ("auto", "cpu", "cuda"; anything else is a loom::UsageError naming `setting`).
c10::Device select_device(const std::string& requested, int local_rank,
                          const std::string& setting = "training.device", bool share_devices = false);

// What the metrics need to know about a device: its name, its memory, and the peak it is measured
// against. The CPU's name is "cpu" and its memory 0 (its peak FLOP/s are measured, not looked up:
// train/metrics.h).
struct DeviceInfo {
  std::string name;
  int64_t total_memory_bytes = 0;
  std::optional<double> peak_bf16_flops;  // dense bf16 tensor-core peak, when the table knows it
};
DeviceInfo device_info(c10::Device device);

// Dense (no sparsity) bf16 peak FLOP/s of an accelerator from its reported name (e.g. "NVIDIA
// H100 80GB HBM3"), from the vendors' data sheets: what MFU is measured against, as TorchTitan
// does. nullopt for a name the table does not know: MFU is then not guessed (set
// metrics.peak_flops).
std::optional<double> peak_bf16_flops_by_name(const std::string& name);

// Waits for the work queued on `device` (a no-op on the CPU), so a host timer read after it covers
// the device's work too.
void synchronize(c10::Device device);

// Makes `device` this thread's current device of its type (torch.cuda.set_device): allocations
// that name no device index, NCCL's communicators and the caching allocator's pools then use the
// rank's own GPU rather than device 0. No-op for the CPU. Device-generic (no CUDA headers).
void set_current_device(c10::Device device);

}  // namespace loom
