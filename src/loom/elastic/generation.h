// How a layout shrinks and regrows with its membership. A *replica* is one data-parallel index:
// the pp x cp x tp ranks that together hold one copy of the model (or one copy of an FSDP shard of
// it). A rank lost takes its whole replica out of training; the replica's other ranks become
// spares until a replacement completes a replica again. Data-parallel degrees are re-derived from
// the replicas left, at the same global batch: more micro-batches per rank (or smaller ones).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom::elastic {

// The job's layout as configured (its first generation).
struct BaseLayout {
  int64_t dp_replicate = 1;
  int64_t dp_shard = 1;
  int64_t cp = 1;
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t local_batch_size = 1;   // rows per micro-batch per data-parallel rank
  int64_t global_batch_size = 1;  // rows per optimizer step (all micro-batches, all replicas)
  int64_t model_parallel() const { return pp * cp * tp; }
  int64_t replicas() const { return dp_replicate * dp_shard; }
};

// The world rank of (pp index, data-parallel index d, cp index, tp index) in Loom's mesh order
// [pp, dp_replicate, dp_shard, cp, tp] with `replicas` data-parallel indices.
int64_t world_rank(const BaseLayout& base, int64_t replicas, int64_t pp_index, int64_t dp_index,
                   int64_t cp_index, int64_t tp_index);
// The model-parallel position of a world rank: pp, cp and tp indices flattened in that order.
int64_t model_parallel_index(const BaseLayout& base, int64_t replicas, int64_t rank);
int64_t data_parallel_index(const BaseLayout& base, int64_t replicas, int64_t rank);

// One generation's layout.
struct GenerationLayout {
  int64_t generation = -1;  // the membership it was planned for (set by the caller)
  std::vector<int64_t> trainers;  // member ids, in world-rank order
  std::vector<int64_t> spares;    // members waiting for the rest of a replica (or for a batch that divides)
  int64_t dp_replicate = 1;
  int64_t dp_shard = 1;
  int64_t local_batch_size = 1;
  int64_t replicas() const { return dp_replicate * dp_shard; }
  // An FSDP shard has no data-parallel replica: a lost one needs a copy kept elsewhere.
  bool shards_need_copies() const { return dp_replicate == 1 && dp_shard > 1; }
  std::string describe() const;
};

// The layout for `members` (the launcher's order: survivors as they were, then joiners), given the
// previous generation's (empty for the first). Complete replicas of the previous generation keep
// their ranks' positions; members of broken replicas and joiners form new replicas in member
// order. The data-parallel count is the largest that divides the global batch; dp_replicate is
// kept where it divides it, else the replicas are all FSDP shards. No replica at all: trainers is
// empty (every member waits).
GenerationLayout plan_generation(const BaseLayout& base, const GenerationLayout& previous,
                                 const std::vector<int64_t>& members);

}  // namespace loom::elastic
