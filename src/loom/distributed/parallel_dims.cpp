#include "loom/distributed/parallel_dims.h"

#include "loom/core/error.h"

namespace loom::distributed {

ParallelDims::ParallelDims(const ParallelDegrees& d, int world_size, int rank)
    : dp_replicate_(d.dp_replicate),
      dp_shard_(d.dp_shard),
      cp_(d.cp),
      tp_(d.tp),
      pp_(d.pp),
      ep_(d.ep),
      world_size_(world_size),
      rank_(rank) {
  LOOM_REQUIRE_USAGE(world_size >= 1, "world size ", world_size, " must be >= 1");
  LOOM_REQUIRE_USAGE(rank >= 0 && rank < world_size, "rank ", rank, " is outside world size ",
                     world_size);
  const std::pair<const char*, int> degrees[] = {
      {"dp_replicate", dp_replicate_}, {"dp_shard", dp_shard_}, {"cp", cp_}, {"tp", tp_},
      {"pp", pp_}};
  std::string minus_one;
  for (const auto& [name, v] : degrees) {
    if (v == -1) minus_one += (minus_one.empty() ? "" : ", ") + std::string(name);
  }
  LOOM_REQUIRE_USAGE(minus_one.empty() || minus_one == "dp_shard",
                     "parallel degree -1 (use the remaining ranks) is set for ", minus_one,
                     "; only dp_shard may be -1, give the others explicit degrees");
  for (const auto& [name, v] : degrees) {
    LOOM_REQUIRE_USAGE(v >= 1 || (v == -1 && std::string(name) == "dp_shard"), name, " = ", v,
                       " is not a valid parallel degree; use a degree >= 1",
                       std::string(name) == "dp_shard" ? " or -1 for the remaining ranks" : "");
  }
  const int others = dp_replicate_ * cp_ * tp_ * pp_;
  if (dp_shard_ == -1) {
    LOOM_REQUIRE_USAGE(world_size % others == 0, "dp_shard = -1 cannot fill world size ",
                       world_size, ": dp_replicate ", dp_replicate_, " x cp ", cp_, " x tp ", tp_,
                       " x pp ", pp_, " = ", others, " does not divide it");
    dp_shard_ = world_size / others;
  }
  const int product = others * dp_shard_;
  LOOM_REQUIRE_USAGE(product == world_size, "dp_replicate ", dp_replicate_, " x dp_shard ",
                     dp_shard_, " x cp ", cp_, " x tp ", tp_, " x pp ", pp_, " = ", product,
                     " != world size ", world_size, "; make the degrees multiply to ", world_size,
                     " (or set dp_shard = -1)");
  LOOM_REQUIRE_USAGE(ep_ >= 1, "parallelism.expert_parallel_degree = ", ep_, " is not a valid parallel degree; use a degree >= 1");
  const int borrowed = dp_shard_ * cp_ * tp_;
  LOOM_REQUIRE_USAGE(borrowed % ep_ == 0, "parallelism.expert_parallel_degree ", ep_, " does not divide dp_shard ", dp_shard_,
                     " x cp ", cp_, " x tp ", tp_, " = ", borrowed,
                     "; experts are split over ranks of that block: pick a divisor of ", borrowed);
}

MeshLayout ParallelDims::sparse_mesh_layout() const {
  std::vector<std::string> names;
  std::vector<int> sizes;
  if (pp_ > 1) {
    names.emplace_back("pp");
    sizes.push_back(pp_);
  }
  if (dp_replicate_ > 1) {
    names.emplace_back("dp_replicate");
    sizes.push_back(dp_replicate_);
  }
  names.emplace_back("efsdp");
  sizes.push_back(efsdp());
  names.emplace_back("ep");
  sizes.push_back(ep_);
  return MeshLayout(std::move(names), std::move(sizes));
}

MeshLayout ParallelDims::mesh_layout() const {
  std::vector<std::string> names;
  std::vector<int> sizes;
  const std::pair<const char*, int> order[] = {
      {"pp", pp_}, {"dp_replicate", dp_replicate_}, {"dp_shard", dp_shard_}, {"cp", cp_},
      {"tp", tp_}};
  for (const auto& [name, v] : order) {
    if (v > 1) {
      names.emplace_back(name);
      sizes.push_back(v);
    }
  }
  return MeshLayout(std::move(names), std::move(sizes));
}

std::vector<std::pair<std::string, std::vector<std::string>>> ParallelDims::flattened_dims()
    const {
  std::vector<std::string> dp, dp_shard_cp, dp_cp;
  if (dp_replicate_enabled()) {
    dp.push_back("dp_replicate");
    dp_cp.push_back("dp_replicate");
  }
  if (dp_shard_enabled()) {
    dp.push_back("dp_shard");
    dp_shard_cp.push_back("dp_shard");
    dp_cp.push_back("dp_shard");
  }
  if (cp_enabled()) {
    dp_shard_cp.push_back("cp");
    dp_cp.push_back("cp");
  }
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  if (!dp.empty()) out.emplace_back("dp", dp);
  if (!dp_shard_cp.empty()) out.emplace_back("dp_shard_cp", dp_shard_cp);
  if (!dp_cp.empty()) out.emplace_back("dp_cp", dp_cp);
  return out;
}

DeviceMesh ParallelDims::build_mesh(const std::shared_ptr<Distributed>& dist) const {
  LOOM_REQUIRE(dist != nullptr, "build_mesh needs an initialized Distributed context");
  LOOM_REQUIRE(dist->world_size() == world_size_ && dist->rank() == rank_, "parallel dims for rank ",
               rank_, " of ", world_size_, " do not match the process group (rank ", dist->rank(),
               " of ", dist->world_size(), ")");
  MeshLayout layout = mesh_layout();
  DeviceMesh mesh(dist, layout.dim_names(), layout.dim_sizes());
  for (const auto& [name, parts] : flattened_dims()) mesh.flatten(parts, name);
  if (ep_enabled()) mesh.add_view(sparse_mesh_layout());
  return mesh;
}

int ParallelDims::coordinate(const char* dim) const {
  const MeshLayout layout = mesh_layout();
  if (!layout.has_dim(dim)) return 0;
  return layout.coordinates(rank_)[layout.dim_index(dim)];
}

int ParallelDims::dp_replicate_rank() const { return coordinate("dp_replicate"); }
int ParallelDims::dp_shard_rank() const { return coordinate("dp_shard"); }
int ParallelDims::cp_rank() const { return coordinate("cp"); }
int ParallelDims::tp_rank() const { return coordinate("tp"); }
int ParallelDims::pp_rank() const { return coordinate("pp"); }
int ParallelDims::dp_rank() const { return dp_replicate_rank() * dp_shard_ + dp_shard_rank(); }

std::string ParallelDims::describe() const {
  return c10::str("dp_replicate=", dp_replicate_, " dp_shard=", dp_shard_, " cp=", cp_, " tp=",
                  tp_, " pp=", pp_, ep_ > 1 ? c10::str(" ep=", ep_, " efsdp=", efsdp()) : std::string(),
                  " (world ", world_size_, ")");
}

}  // namespace loom::distributed
