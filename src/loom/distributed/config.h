// The [comm] section of a job config: how long rendezvous and each collective may take.
#pragma once
#include <cstdint>

#include "loom/core/options.h"

namespace loom::distributed {

// comm.timeout_seconds is turned into std::chrono milliseconds (and nanoseconds deeper down);
// one week is far beyond any real rendezvous or collective and far from overflowing them.
inline constexpr int64_t kMaxCommTimeoutSeconds = 7 * 24 * 3600;

struct CommConfig {
  int64_t timeout_seconds = 300;  // at most kMaxCommTimeoutSeconds
  // Ranks on one host exchange CPU tensors through shared memory (shm_collectives.h), not Gloo.
  bool shared_memory = true;

  bool operator==(const CommConfig&) const = default;
};
const options::Section& comm_section();

}  // namespace loom::distributed
