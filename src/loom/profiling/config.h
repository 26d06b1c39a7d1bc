// The [profiling] section of a job config, TorchTitan's keys: Kineto traces of a few steps in every
// window of profile_freq, and a memory record (CUDA allocator snapshots, or an RSS timeline on the
// CPU). Both folders are relative to job.dump_folder.
#pragma once
#include <cstdint>
#include <string>

#include "loom/core/options.h"

namespace loom::profiling {

struct ProfilingConfig {
  bool enable_profiling = false;
  std::string save_traces_folder = "profile_traces";
  int64_t profile_freq = 10;
  int64_t profiler_active = 1;
  int64_t profiler_warmup = 3;
  bool enable_memory_snapshot = false;
  std::string save_memory_snapshot_folder = "memory_snapshot";

  bool operator==(const ProfilingConfig&) const = default;
};
const options::Section& profiling_section();

}  // namespace loom::profiling
