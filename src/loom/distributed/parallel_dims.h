// The parallelism degrees of a run and every rank/mesh decision derived from them, as in
// TorchTitan: dp_replicate (DDP/HSDP replicas) x dp_shard (FSDP) x cp x tp x pp = world size, with
// dp_shard = -1 meaning "all ranks the other degrees leave". The mesh keeps only degrees > 1, in the
// order [pp, dp_replicate, dp_shard, cp, tp] (tp innermost: neighbouring ranks), and registers the
// flattened dims "dp" (dp_replicate, dp_shard), "dp_shard_cp" (dp_shard, cp) and "dp_cp"
// (dp_replicate, dp_shard, cp) — each only when one of its parts is enabled.
//
// Expert parallelism (ep) borrows its ranks from dp_shard x cp x tp, as TorchTitan's: the routed
// experts are split over `ep` consecutive ranks of that block and FSDP-sharded over the
// efsdp = dp_shard x cp x tp / ep ranks left, on a second, sparse view of the same ranks:
// [pp, dp_replicate, efsdp, ep] (ep innermost). With ep > 1 the mesh registers "efsdp" and "ep".
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/distributed/device_mesh.h"

namespace loom::distributed {

struct ParallelDegrees {
  int dp_replicate = 1;
  int dp_shard = -1;
  int cp = 1;
  int tp = 1;
  int pp = 1;
  int ep = 1;  // expert parallel: a divisor of dp_shard x cp x tp
};

class ParallelDims {
 public:
  // Validates and resolves dp_shard = -1. Throws loom::UsageError with one line naming the bad
  // degree(s), e.g. "dp_replicate 2 x dp_shard 3 x cp 1 x tp 1 x pp 1 = 6 != world size 8".
  ParallelDims(const ParallelDegrees& degrees, int world_size, int rank = 0);

  int dp_replicate() const { return dp_replicate_; }
  int dp_shard() const { return dp_shard_; }
  int cp() const { return cp_; }
  int tp() const { return tp_; }
  int pp() const { return pp_; }
  int ep() const { return ep_; }
  // The ranks each expert's FSDP shards over: dp_shard x cp x tp / ep.
  int efsdp() const { return dp_shard_ * cp_ * tp_ / ep_; }
  int world_size() const { return world_size_; }
  int rank() const { return rank_; }

  bool dp_enabled() const { return dp_degree() > 1; }
  bool dp_replicate_enabled() const { return dp_replicate_ > 1; }
  bool dp_shard_enabled() const { return dp_shard_ > 1; }
  bool cp_enabled() const { return cp_ > 1; }
  bool tp_enabled() const { return tp_ > 1; }
  bool pp_enabled() const { return pp_ > 1; }
  bool ep_enabled() const { return ep_ > 1; }
  // FSDP shards over dp_shard x cp (cp ranks hold different sequence chunks of the same batch, so
  // their parameters are sharded and gradients reduced together with dp_shard).
  bool fsdp_enabled() const { return dp_shard_enabled() || cp_enabled(); }
  bool dp_cp_enabled() const { return dp_enabled() || cp_enabled(); }

  int dp_degree() const { return dp_replicate_ * dp_shard_; }  // data-parallel batch split
  int non_data_parallel_size() const { return cp_ * tp_ * pp_; }
  // Sequence lengths must divide by this for sequence parallel (tp) and load-balanced cp.
  int seq_len_divisor() const { return tp_ * cp_ * 2; }

  // This rank's coordinates (pure arithmetic over the mesh layout).
  int dp_rank() const;  // index among dp_degree() data-parallel ranks
  int dp_replicate_rank() const;
  int dp_shard_rank() const;
  int cp_rank() const;
  int tp_rank() const;
  int pp_rank() const;

  // The mesh layout: dims > 1 in [pp, dp_replicate, dp_shard, cp, tp] order.
  MeshLayout mesh_layout() const;
  // The experts' view with ep > 1: [pp, dp_replicate, efsdp, ep] (pp and dp_replicate when > 1;
  // efsdp even at size 1, so expert FSDP always has its group).
  MeshLayout sparse_mesh_layout() const;
  // The flattened dims to register: (name, parts), in registration order.
  std::vector<std::pair<std::string, std::vector<std::string>>> flattened_dims() const;
  // Creates the mesh with its groups. `dist` must match world size and rank.
  DeviceMesh build_mesh(const std::shared_ptr<Distributed>& dist) const;

  std::string describe() const;  // "dp_replicate=1 dp_shard=4 cp=1 tp=2 pp=1 (world 8)", "... ep=2 ..." with EP

 private:
  int coordinate(const char* dim) const;

  int dp_replicate_, dp_shard_, cp_, tp_, pp_, ep_;
  int world_size_;
  int rank_;
};

}  // namespace loom::distributed
