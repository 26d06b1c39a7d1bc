// The parallel layouts `loom check-layouts` compares, as the user writes them ("pp=2,tp=2"), and the
// `--section.key=value` overrides that make a run of a config that layout with the reference's
// global batch.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom::layouts {

// One layout: its degrees (1 where not given) and the other settings it names.
//   fsdp=N               parallelism.data_parallel_shard_degree
//   hsdp=N, dp=N,        parallelism.data_parallel_replicate_degree (HSDP with fsdp > 1, DDP
//   replicate=N          without)
//   tp=N                 parallelism.tensor_parallel_degree
//   async_tp=true|false  parallelism.enable_async_tensor_parallel
//   cp=N                 parallelism.context_parallel_degree
//   pp=N                 parallelism.pipeline_parallel_degree
//   pp_schedule=NAME     parallelism.pipeline_parallel_schedule
//   microbatch=N         parallelism.pipeline_parallel_microbatch_size
//   ep=N                 parallelism.expert_parallel_degree (borrows ranks: no world size of its own)
//   section.key=value    passed through as --section.key=value (not the degrees, which have the
//                        keys above, nor training.local_batch_size, which follows the global batch)
struct LayoutSpec {
  std::string text;  // as given, the layout's name in the output
  int dp_replicate = 1;
  int dp_shard = 1;
  int tp = 1;
  int cp = 1;
  int pp = 1;
  int ep = 1;
  std::vector<std::string> settings;  // --parallelism.* (other than degrees) and passthrough overrides

  int world_size() const { return dp_replicate * dp_shard * tp * cp * pp; }
  int dp_degree() const { return dp_replicate * dp_shard; }
  // The overrides that make a run this layout: every degree (1 where not given, so the config's
  // own degrees do not leak in), then `settings`, then the local batch.
  std::vector<std::string> overrides(int64_t local_batch_size) const;
};

// Parses "key=value[,key=value...]"; throws loom::UsageError (one line naming the layout and the
// key) on an empty layout, an item without '=', an unknown key, a repeated key, or a degree that
// is not a positive integer.
LayoutSpec parse_layout(const std::string& text);

// Rows per loaded batch on each of `layout`'s data-parallel ranks so that every step sees
// `global_rows` rows (per accumulation step) like the reference; throws loom::UsageError when they
// do not split evenly.
int64_t local_batch_for(const LayoutSpec& layout, int64_t global_rows);

// The override keys check-layouts sets itself (each layout's degrees and local batch) or forces
// (deterministic mode): throws loom::UsageError when the extra train overrides name one, with
// the option to use instead.
void check_extra_overrides(const std::vector<std::string>& overrides);

}  // namespace loom::layouts
