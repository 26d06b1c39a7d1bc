// The settings that do not compose in this build, as one table (feature x feature -> message):
// each row names the two features, when it applies and the one-line message (what was asked and
// what to set instead). The config check runs every row that reads only the config at load time;
// the Trainer runs the rest with the resolved parallel degrees, still before any process group
// exists. A refusal lives here once; the features' own code keeps internal assertions only. An
// optimizer's own refusals stay with its registry entry (parallel/optimizer_registry.h), a model's
// with its spec's validate_layout (what its shapes cannot be split into).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "loom/distributed/parallel_dims.h"
#include "loom/train/config.h"

namespace loom::train {

struct Incompatibility {
  std::string first;   // "float8.enable"
  std::string second;  // "tensor parallelism"
  // Whether the row applies; `dims` is null at config load (rows needing the resolved degrees
  // then wait for the Trainer's check).
  std::function<bool(const JobConfig&, const distributed::ParallelDims* dims)> applies;
  bool needs_dims = false;
  std::function<std::string(const JobConfig&)> message;
};

const std::vector<Incompatibility>& incompatibilities();

// The first row that applies, as a loom::UsageError (exit 2) with its message.
void check_compatibility(const JobConfig& config, const distributed::ParallelDims* dims);

// The table as docs/config.md shows it.
std::string compatibility_markdown();

}  // namespace loom::train
