// A given layout's place among every layout training accepts for the same model, devices and
// global batch (issue 50, item 4): each candidate at the fastest of its memory settings that fits
// (plan::fastest_fitting), the given one too, ranked by predicted tokens/s per device.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/plan/search.h"
#include "loom/plan/time_model.h"

namespace loom::plan {

struct Ranking {
  Priced given;                // the layout at its fastest settings that fit
  std::vector<Priced> fitting;  // every candidate that fits, fastest first
  int64_t accepted = 0;        // candidates training accepts (fitting or not)
  int64_t rank = 0;            // 1 + the fitting candidates strictly faster than `given`
  // rank / fitting.size(): "top 7.9 %" is 0.079.
  double top_fraction() const {
    return fitting.empty() ? 1.0 : static_cast<double>(rank) / static_cast<double>(fitting.size());
  }
};

// `config`: the run with its own layout's settings left as they are (the candidates' degrees are
// the search's); Float8 is held as `layout.float8` says (empty: the config's) for every candidate,
// so layouts are compared in one precision. `capacity_gib` 0: no memory limit. `fixed`: keep the
// config's memory settings instead of choosing per layout.
Ranking rank_layout(const models::ModelSpec& spec, const models::ModelArgs& args, const ModelShape& shape,
                    const train::JobConfig& config, const Layout& layout, const Cluster& cluster, double capacity_gib,
                    int world_size, int devices_per_node, int64_t vocab_size, bool fixed = false);

}  // namespace loom::plan
