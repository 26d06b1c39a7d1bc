// The layouts `loom plan` chooses from: every way to lay a model out on a number of devices that
// `loom train` would accept, each as the config it would run with.
//
// The search runs over the data-parallel replicate and shard degrees, context, tensor and pipeline
// parallel degrees, expert parallel (models whose parameters are not all active per token), the
// pipeline schedule and micro-batch size, and the local batch (with gradient accumulation making
// up the global batch). Every candidate is checked by train::check_layout -- the very function the
// Trainer calls before its rendezvous -- so what the planner emits is exactly what training
// accepts: there is no second copy of the divisibility rules here. Settings that only change
// memory and speed (activation checkpointing, Float8, resharding after forward) are the cost
// model's to choose and do not multiply the layouts checked here.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/train/config.h"

namespace loom::plan {

struct SearchRequest {
  // The run's settings: model (name, flavor, vocab_size, n_layers), training (seq_len and
  // global_batch_size, in rows), optimizer, precision. The parallelism section is what the search
  // fills in; training.local_batch_size is chosen per layout.
  train::JobConfig base;
  int world_size = 1;
  // Tensor parallelism stays inside a node (its collectives sit on every layer's critical path),
  // as TorchTitan and Megatron-LM configure it.
  int devices_per_node = 8;
  int64_t vocab_size = 0;  // the model's embedding rows; 0 = the flavor's
  // Pipeline schedules tried when pp > 1 (pipeline/generators.h names).
  std::vector<std::string> schedules = {"1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"};
  int64_t max_gradient_accumulation = 8;  // local batches per optimizer step, at most
};

// One layout and how it runs: the `parallelism` degrees, the schedule and micro-batch size (pp >
// 1), the local batch and the gradient accumulation that makes up the global batch.
struct Layout {
  int dp_replicate = 1;
  int dp_shard = 1;
  int cp = 1;
  int tp = 1;
  int pp = 1;
  int ep = 1;
  std::string schedule;  // empty when pp == 1
  int64_t microbatch_size = 1;
  int64_t local_batch_size = 1;
  int64_t grad_accum_steps = 1;
  // Memory-for-speed settings the cost model chooses per layout (empty: the config's own):
  // activation checkpointing ("none", "selective" -- per op --, "full") and FSDP's
  // reshard_after_forward ("never": the forward's gathered groups stay until their backward).
  std::string ac_mode;
  std::string reshard_after_forward;
  // Float8 training of the blocks' linears ("on" / "off"; empty: the config's), chosen where the
  // cluster's devices have float8 GEMMs (Cluster::float8_gemm_speedup).
  std::string float8;
  // FSDP across the micro-batches of one step (issue 50): "on" keeps the gathered parameters and
  // the unsharded gradients from the first micro-batch to the last and reduces once after it (one
  // all-gather and one reduce-scatter per step, as FSDP2 users get with
  // set_requires_gradient_sync(False) and no resharding until the step's end), at the memory of
  // every group of the rank unsharded; "off" or empty: gathered and reduced per micro-batch (Loom's
  // behaviour before issue 50's item 1). A planner input: no `loom train` key selects it yet, so
  // overrides() leaves it out.
  std::string fsdp_accumulate;

  // The `loom train` flags that select this layout on top of the request's config.
  std::vector<std::string> overrides() const;
  // Writes the layout into `config`'s parallelism section and training.local_batch_size.
  void apply_to(train::JobConfig& config) const;
  // "dp_shard 8 x tp 8 x pp 4 (Interleaved1F1B, micro-batch 1), local batch 4".
  std::string describe() const;
  friend bool operator==(const Layout&, const Layout&) = default;
};

struct SearchResult {
  std::vector<Layout> layouts;  // each passed train::check_layout
  int64_t candidates = 0;       // layouts proposed, accepted or not
  double seconds = 0;
};

// Throws loom::UsageError when the request itself cannot describe a run (world size < 1, no
// global batch, a global batch that no data-parallel degree of the world divides).
SearchResult enumerate_layouts(const SearchRequest& request);

}  // namespace loom::plan
