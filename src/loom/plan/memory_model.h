// Memory per device of one layout, predicted from the model's own shapes (its parameters built on
// the meta device), Loom's sharding (FSDP's planner for the shards and their padding, TP's split of
// the linears, EP's of the experts), the activations each block saves per AC mode, FSDP's buffers
// in flight and, under pipeline parallelism, the micro-batches each rank holds at once (walked
// from the schedule the run would execute). The parts match train/memory_accounting.h's breakdown
// (metrics.memory_breakdown), which is what the predictions are checked against.
//
// What the activation model counts per token and layer of a pre-norm decoder block (elements of
// the compute dtype c, the residual dtype r; s = tp under sequence parallel, else 1):
//   attention norm input r*dim/s and rstd; its normed output, all-gathered under SP, c*dim;
//   q and k after RoPE, v, the attention output and its logsumexp: c*(dim + 2 kv + dim)/tp + 4 H/tp;
//   the output projection's input c*dim/tp; the FFN norm input r*dim/s, rstd, normed c*dim;
//   gate, up and the SwiGLU output 3 c*ffn/tp.
// A checkpointed block keeps only its input and, during its backward, recomputes the rest; the
// output head keeps its input, the normed hidden and the fused loss's gradients.
// A Mixture-of-Experts block replaces the FFN's 3 c*ffn/tp (per token) with its routed part, per
// token routed to k of E experts of hidden width h, with shared experts of width hs:
//   k rows of the permuted input (the grouped GEMMs' input), c*dim each; their gate, up and SwiGLU
//   output, 3 c*h; the fp32 expert output that the product with its routing weight keeps, 4*dim,
//   and the weight, 4 (MoE::forward: the index_selects keep their indices, the casts nothing);
//   the shared experts' 3 c*hs; the router's fp32 logits and scores, 8*E.
// Under expert parallelism a rank computes, on average, the same number of rows (its experts get
// k rows per token from every rank of the group), so the count does not change with ep.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/models/spec.h"
#include "loom/plan/search.h"
#include "loom/train/config.h"

namespace loom::plan {

// One model's parameters as the planner needs them, built once per model (meta device).
struct ModelShape {
  struct Tensor {
    std::string name;
    int64_t numel = 0;
    int tp_split = -1;     // the dim tensor parallelism splits (-1: replicated across TP)
    bool expert = false;   // a routed expert's stacked weight (split by EP over its dim 0)
  };
  struct Group {           // an FSDP group: the embedding, one block, the head
    std::string name;      // "tok_embeddings", "layers.3", "head"
    int64_t layer = -1;    // the block's layer id (-1: not a block)
    std::vector<Tensor> tensors;
    // A Mixture-of-Experts block's routed part (experts == 0: a dense block).
    struct Moe {
      int64_t experts = 0, top_k = 0, hidden = 0, shared_hidden = 0, groups = 1, topk_groups = 1;
    } moe;
    // Groups with the same tensors (numel, TP split, expert) share an id (ModelShape::of): the
    // memory model shards each distinct group once per layout, not each of a 405B's 126 blocks.
    int shape_id = 0;
  };
  int num_group_shapes = 0;
  // Sums the time model reads for every layout (ModelShape::of): parameter elements replicated,
  // split by TP only, by EP only and by both; the blocks' dense linear weights (what Float8
  // converts); MoE layers and their top-k summed.
  double elems_plain = 0, elems_tp = 0, elems_expert = 0, elems_tp_expert = 0, linear_elems = 0;
  int64_t moe_layers = 0, moe_top_k_sum = 0;
  // The routers' group-limited routing (the first MoE layer's; DeepSeek-V3: a token's experts come
  // from 4 of 8 groups): groups and groups a token may use (1 and 1: not limited).
  int64_t moe_groups = 1, moe_topk_groups = 1;
  std::vector<Group> groups;  // embedding, layers in order, head
  int64_t dim = 0, n_layers = 0, n_heads = 0, kv_dim = 0, ffn = 0, vocab = 0;

  static ModelShape of(const models::ModelSpec& spec, const models::ModelArgs& args);
};

struct MemoryEstimate {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  int64_t activations = 0;
  int64_t buffers_in_flight = 0;
  int64_t peak = 0;     // the sum of the parts at the step's peak
  int pipeline_rank = 0;  // the rank the figures are for (the one with the highest peak)
  std::vector<int64_t> rank_peaks;  // every pipeline rank's peak, by pipeline rank
  std::string describe() const;  // "parameters 1.20 GiB, ... = peak 9.80 GiB"
};

// The memory of the rank with the highest peak. `config`: the run's settings with the layout
// applied (Layout::apply_to).
MemoryEstimate estimate_memory(const ModelShape& shape, const models::ModelArgs& args,
                               const train::JobConfig& config, const Layout& layout);

}  // namespace loom::plan
