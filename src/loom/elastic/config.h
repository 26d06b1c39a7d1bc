// The [fault_tolerance] section of a job config: elastic training (docs/fault_tolerance.md). With
// `enable`, a run under `loom launch` that loses a rank keeps going on the survivors, re-sharded,
// at the same global batch, and takes a replacement back at a step boundary; off, a lost rank
// stops the job and `--max-restarts` restarts every rank from the newest checkpoint.
#pragma once
#include <cstdint>

#include "loom/core/options.h"

namespace loom::elastic {

enum class ShardCopy { kHostMemory, kNeighbour };
const options::EnumNames<ShardCopy>& option_names(ShardCopy);

struct FaultToleranceConfig {
  bool enable = false;
  // The fewest data-parallel replicas (whole model-parallel groups) training continues with; below
  // it the members wait for replacements.
  int64_t min_replicas = 1;
  // How long members without enough replicas to train wait for a replacement before they give up
  // (one line, exit 1).
  int64_t join_timeout_seconds = 300;
  // Where the copy of an FSDP shard without a data-parallel replica lives: "host_memory" (each
  // rank's own, in /dev/shm: survives the rank, not its host) or "neighbour" (the next
  // data-parallel rank's memory: survives the host, costs a transfer per step).
  ShardCopy shard_copy = ShardCopy::kHostMemory;

  bool operator==(const FaultToleranceConfig&) const = default;
};
const options::Section& fault_tolerance_section();

}  // namespace loom::elastic
