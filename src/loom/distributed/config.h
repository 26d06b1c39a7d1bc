// The [comm] section of a job config: how long rendezvous and each collective may take.
#pragma once
#include <cstdint>

#include "loom/core/options.h"

namespace loom::distributed {

// comm.timeout_seconds is turned into std::chrono milliseconds (and nanoseconds deeper down);
// one week is far beyond any real rendezvous or collective and far from overflowing them.
inline constexpr int64_t kMaxCommTimeoutSeconds = 7 * 24 * 3600;

// How collectives on a rank's GPU tensors travel. kNccl: NCCL, one GPU per rank (production).
// kHost: each device tensor is copied to host memory, exchanged by the CPU transport (shared
// memory or Gloo) and copied back, so several ranks may share one GPU (NCCL refuses two ranks on
// one device): parallel layouts can then be checked on CUDA tensors on a machine with one GPU.
// Slow by design (a device-to-host copy waits for the GPU); for tests, not for training.
enum class DeviceTransport { kNccl, kHost };
const options::EnumNames<DeviceTransport>& option_names(DeviceTransport);

struct CommConfig {
  int64_t timeout_seconds = 300;  // at most kMaxCommTimeoutSeconds
  // Ranks on one host exchange CPU tensors through shared memory (shm_collectives.h), not Gloo.
  bool shared_memory = true;
  DeviceTransport device_transport = DeviceTransport::kNccl;

  bool operator==(const CommConfig&) const = default;
};
const options::Section& comm_section();

}  // namespace loom::distributed
