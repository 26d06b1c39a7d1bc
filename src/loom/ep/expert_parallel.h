// Expert parallelism (TorchTitan's ExpertParallel, DeepSeek's EP), applied to an MoE layer from
// outside: the routed experts' stacked weights (and biases, where the experts have them: GPT-OSS's
// b1, b2, b3) are split along the expert dim over the "ep" group
// (Shard(0): rank r of P keeps experts [r E/P, (r+1) E/P)), and the layer's permuted tokens travel
// to the rank holding their expert and back:
//
//   1. counts     each rank's per-expert token counts go to the experts' ranks (all-to-all of
//                 E integers), so every rank knows how many rows it sends and receives;
//   2. dispatch   the rows, already sorted by expert, go to their experts' ranks (all-to-all with
//                 variable splits); they arrive grouped by source rank, then by local expert;
//   3. compute    regrouped by local expert (then source rank, a fixed order), the local experts
//                 run on them (GroupedExperts, an expert or a whole rank may get none);
//   4. combine    the outputs go back in the order they came (the inverse regrouping, then the
//                 reverse all-to-all), and the MoE layer weights and sums them as without EP.
//
// Backward runs the same exchanges in reverse (tensor::all_to_all_rows): each expert's weight
// gradient is the sum over every token of the ep group routed to it; the experts' FSDP over efsdp
// then divides by the data-parallel degree (models/common/parallelize.cpp). The router, its
// selection bias, its gate's bias (GPT-OSS) and any shared experts stay replicated: every rank routes its own tokens over all
// E experts, so load balancing is unchanged.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "loom/moe/moe.h"
#include "loom/tensor/collectives.h"

namespace loom::ep {

inline constexpr const char* kMeshDim = "ep";

class ExpertParallel {
 public:
  explicit ExpertParallel(tensor::CommPtr comm);

  const tensor::CommPtr& comm() const { return comm_; }
  int degree() const { return comm_->size(); }

  // Shards `moe`'s routed experts over the group (parameters on the meta device become this
  // rank's [E/P, ...] pieces; materialized ones are cut) with their layout (Shard(0) on "ep") in
  // the slots, and installs the token dispatch. `fqn`: the MoE module's path in the model. A
  // loom::UsageError when the degree does not divide the experts.
  void apply(moe::MoE& moe, const std::string& fqn);
  // The parameters apply() sharded, by full name.
  const std::set<std::string>& sharded_parameters() const { return sharded_; }
  bool is_sharded(const std::string& fqn) const { return sharded_.count(fqn) > 0; }

 private:
  tensor::CommPtr comm_;
  std::set<std::string> sharded_;
};

// Steps 1-4 above for one layer call: `rows` [M, dim] sorted by global expert with counts[e] rows
// for each of the E experts; `experts` holds this rank's E/P of them. Returns the experts' outputs
// for `rows`, row for row. Collective over `comm` (every rank of it calls it for the same layer).
torch::Tensor dispatch_to_experts(moe::GroupedExperts& experts, const torch::Tensor& rows,
                                  const std::vector<int64_t>& counts, const tensor::CommPtr& comm);

// Bytes this rank sends to the other ranks of the group (all-to-all wire bytes) for one MoE
// layer's forward and backward: the counts exchange (E int64, all but its own E/P), then the rows
// it dispatches to other ranks' experts and the rows it returns to them, each once in forward and
// once (as gradients) in backward. `counts[s][e]`: the tokens rank s routes to expert e; `dim`
// rows of `element_bytes`. The formula of docs/moe.md, exact (the EP tests compare it with the
// measured counters).
int64_t dispatch_wire_bytes(const std::vector<std::vector<int64_t>>& counts, int rank, int64_t dim,
                            int64_t element_bytes);

}  // namespace loom::ep
