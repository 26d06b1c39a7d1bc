#include "loom/plan/ranking.h"

#include <algorithm>

namespace loom::plan {

Ranking rank_layout(const models::ModelSpec& spec, const models::ModelArgs& args, const ModelShape& shape,
                    const train::JobConfig& config, const Layout& layout, const Cluster& cluster, double capacity_gib,
                    int world_size, int devices_per_node, int64_t vocab_size, bool fixed) {
  const std::string float8 = !layout.float8.empty() ? layout.float8 : config.float8.enable ? "on" : "off";
  Layout given = layout;
  given.float8 = float8;
  Ranking out;
  out.given = fastest_fitting(spec, args, shape, config, given, cluster, capacity_gib, fixed);
  SearchRequest request;
  request.base = config;
  request.world_size = world_size;
  request.devices_per_node = devices_per_node;
  request.vocab_size = vocab_size;
  const SearchResult found = enumerate_layouts(request);
  out.accepted = static_cast<int64_t>(found.layouts.size());
  for (Layout candidate : found.layouts) {
    candidate.float8 = float8;
    Priced p = fastest_fitting(spec, args, shape, config, candidate, cluster, capacity_gib, fixed);
    if (p.fits) out.fitting.push_back(std::move(p));
  }
  std::stable_sort(out.fitting.begin(), out.fitting.end(), [](const Priced& a, const Priced& b) {
    return a.time.tokens_per_device_s > b.time.tokens_per_device_s;
  });
  const double mine = out.given.time.tokens_per_device_s * (1 + 1e-9);
  out.rank = 1 + std::count_if(out.fitting.begin(), out.fitting.end(),
                               [&](const Priced& p) { return p.time.tokens_per_device_s > mine; });
  return out;
}

}  // namespace loom::plan
