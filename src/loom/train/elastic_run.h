// `loom train` with fault_tolerance.enable, one member of an elastic job under `loom launch`
// (docs/fault_tolerance.md). The member loops over memberships (distributed/elastic_protocol.h):
// for each one it plans the layout (elastic/generation.h), forms that membership's world, builds a
// Trainer on it whose state comes from what the members hold in memory (elastic/state_pieces.h:
// their own pieces, and the neighbour copies of FSDP shards that have no replica) rather than from
// a checkpoint, and trains until the run ends, a member is lost (the launcher writes a new
// membership; the step in flight is abandoned, its rows re-issued), or replacements wait to join
// (the members stop together at a step boundary). The Trainer itself stays a plain numbered
// sequence: the world, the state and the two per-step calls come in through TrainerHooks.
#pragma once
#include "loom/train/config.h"

namespace loom::train {

// Runs this member until training ends. A state that cannot be rebuilt in place (a lost shard
// with no copy left) ends it with loom::Error and distributed::kExitElasticRestart, which asks
// `loom launch` for today's restart of every rank from the newest checkpoint.
void run_elastic_training(const JobConfig& config);

}  // namespace loom::train
