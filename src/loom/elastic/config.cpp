#include "loom/elastic/config.h"

namespace loom::elastic {

const options::EnumNames<ShardCopy>& option_names(ShardCopy) {
  static const options::EnumNames<ShardCopy> names = {{"host_memory", ShardCopy::kHostMemory},
                                                       {"neighbour", ShardCopy::kNeighbour}};
  return names;
}

namespace {
void check(const FaultToleranceConfig& c) {
  options::require(c.min_replicas >= 1, fault_tolerance_section(), "min_replicas", "at least 1", &c);
  options::require(c.join_timeout_seconds >= 1, fault_tolerance_section(), "join_timeout_seconds",
                   "at least 1", &c);
}
}  // namespace

const options::Section& fault_tolerance_section() {
  static const options::Section section{
      "fault_tolerance",
      {
          {LOOM_OPTION(FaultToleranceConfig, enable),
           "Elastic training under `loom launch`: when a rank dies, the survivors abandon the step in"
           " flight, re-shard parameters and optimizer state among themselves (a lost FSDP shard"
           " from its copy, see `shard_copy`) and continue at the same global batch; `loom launch"
           " --max-restarts` starts a replacement that joins at a step boundary. Every row is"
           " trained exactly once (metrics.jsonl's `rows` ledger). See docs/fault_tolerance.md for"
           " what combines and what falls back to a restart from the newest checkpoint."},
          {LOOM_OPTION(FaultToleranceConfig, min_replicas),
           "The fewest data-parallel replicas (whole model-parallel groups) training continues with;"
           " with fewer the members wait for replacements (fault_tolerance.join_timeout_seconds)."},
          {LOOM_OPTION(FaultToleranceConfig, shard_copy),
           "Where the copy of an FSDP shard that has no data-parallel replica lives: `host_memory`"
           " (each rank's own copy in /dev/shm, written after every step: one host memcpy, twice the"
           " rank's state in host memory; it survives the rank, not its host) or `neighbour` (the"
           " next data-parallel rank keeps it: one transfer of the rank's state per step; it survives"
           " the host). With HSDP or DDP the other replicas hold every shard and no copy is kept."},
          {LOOM_OPTION(FaultToleranceConfig, join_timeout_seconds),
           "How long members that cannot train (too few replicas, or the rest of their"
           " model-parallel group lost) wait for a new membership before stopping with one line."},
      },
      {},
      {},
      &options::validate_as<FaultToleranceConfig, check>};
  return section;
}

}  // namespace loom::elastic
