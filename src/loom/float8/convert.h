// Converting a model's linear layers to Float8 (torchao's convert_to_float8_training, TorchTitan's
// Float8 model converter), from outside the model: every nn::Linear whose FQN matches none of
// `filter_fqns` gets an around-hook (nn::Module::set_forward_override) computing
// float8_linear(x, W) from the weight its slot holds at each call. The model code knows nothing
// of Float8, and the parameters stay what they were (high precision), so:
//   - FSDP gathers the high-precision weight and the hook quantizes it in forward (and again in
//     backward, from the weight FSDP re-gathered), checkpoints hold high-precision weights;
//   - activation checkpointing re-runs the hook in its recompute (per-op AC leaves linears with an
//     around-hook to the recompute: their outputs are not cached);
//   - tensor parallelism shards the weights afterwards and records their placement in the slots'
//     layouts; the hook reads it at each call and quantizes the shards with the whole tensors'
//     scales (Float8Sharding, over the groups of `sharding_groups`). Async TP, which replaces the
//     linears' around-hooks with its collective matmuls, is refused with Float8 (train/
//     compatibility.cpp);
//   - pipeline stages are converted like the whole model (each part keeps its linears' names).
// Applied first, before any parallelism (TorchTitan's model converters run before parallelize).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/float8/float8.h"
#include "loom/nn/module.h"

namespace loom::float8 {

// The [float8] section of a job config, as written (float8_section() is its schema).
struct Float8Config {
  bool enable = false;
  Recipe recipe = Recipe::kRowwise;
  std::string filter_fqns = "output";  // comma-separated FQN substrings kept in high precision

  bool operator==(const Float8Config&) const = default;
};
const options::Section& float8_section();

// What convert_to_float8 applies.
struct Float8Options {
  Recipe recipe = Recipe::kRowwise;
  // A linear whose FQN contains any of these substrings stays in high precision.
  std::vector<std::string> filter_fqns = {"output"};
  // The groups of the mesh dims a parallelism may shard the converted weights over ("tp"), by
  // name; set by the composition. A weight whose slot layout shards it on one of them is quantized
  // as a piece of the whole (float8_linear's Float8Sharding).
  std::map<std::string, std::shared_ptr<distributed::Comm>> sharding_groups;

  // filter_fqns split at commas, blanks around each ignored, empty entries dropped.
  static Float8Options from(const Float8Config& config);
};

// What convert_to_float8 did, by FQN, in module order.
struct ConversionReport {
  std::vector<std::string> converted;
  std::vector<std::string> kept;  // matched filter_fqns: high precision
  // "12 linears to float8 (rowwise), 1 kept in high precision: output"
  std::string describe(Recipe recipe) const;
};

// Installs the Float8 around-hook on every nn::Linear of `model` not filtered out. A converted
// linear whose in or out features are not multiples of 16 (what the float8 GEMMs need) is a
// loom::UsageError naming it, its dims and the fixes; one that already has an around-hook is an
// internal error (convert before any parallelism).
ConversionReport convert_to_float8(nn::Module& model, const Float8Options& options);

}  // namespace loom::float8
