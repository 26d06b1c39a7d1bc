// The [optimizer] and [parallelism] sections of a job config: what the optimizer registry builds
// and which layout the composition applies.
#pragma once
#include <cstdint>
#include <string>

#include "loom/core/options.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/cp/ring_attention.h"
#include "loom/optim/adamw.h"
#include "loom/optim/muon.h"
#include "loom/parallel/optimizer_registry.h"

namespace loom::parallel {

struct OptimizerConfig {
  std::string name = "AdamW";  // a registered optimizer (optimizer_registry.h)
  double lr = 8e-4;
  double eps = 1e-8;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double weight_decay = 0.1;
  optim::AdamWImplementation implementation = optim::AdamWImplementation::kFused;
  int64_t block_size = 256;  // AdamW8bit: elements per quantization block
  double muon_momentum = 0.95;  // Muon: momentum buffer decay mu
  bool muon_nesterov = true;    // Muon: orthogonalise G + mu * B instead of B
  int64_t muon_ns_steps = 5;    // Muon: Newton-Schulz iterations
  optim::MuonLRAdjust muon_adjust_lr = optim::MuonLRAdjust::kMatchRmsAdamW;

  // What every registered optimizer reads (each takes what it needs).
  OptimizerRequest request() const;

  bool operator==(const OptimizerConfig&) const = default;
};
const options::Section& optimizer_section();

struct ParallelismConfig {
  int64_t data_parallel_replicate_degree = 1;
  int64_t data_parallel_shard_degree = -1;  // -1 = the ranks left over by the other degrees
  std::string fsdp_reshard_after_forward = "default";  // "default" | "always" | "never" | int
  double fsdp_bucket_mb = 0;         // 0 = one FSDP group per block, -1 = automatic, > 0 = MB per bucket
  int64_t fsdp_prefetch_depth = 1;   // FSDP groups whose all-gathers run ahead, >= 0
  // Gradient accumulation: hold the gathered parameters across the step's micro-batches (one
  // all-gather per group per step instead of two per micro-batch); see FsdpSync.
  bool fsdp_accumulate_unsharded = false;
  int64_t tensor_parallel_degree = 1;
  bool disable_sequence_parallel = false;  // TP: keep the residual stream whole between blocks
  bool disable_loss_parallel = false;      // TP: gather the logits for the loss
  bool enable_async_tensor_parallel = false;
  int64_t context_parallel_degree = 1;
  cp::RotateMethod context_parallel_rotate_method = cp::RotateMethod::kAllGather;
  int64_t pipeline_parallel_degree = 1;
  int64_t expert_parallel_degree = 1;  // a divisor of dp_shard x cp x tp and of the routed experts
  std::string pipeline_parallel_schedule = "1F1B";  // TorchTitan's names (pipeline/generators.h)
  std::string pipeline_parallel_schedule_csv;       // a hand-written schedule; "" = none
  int64_t pipeline_parallel_microbatch_size = 1;    // rows per micro-batch
  int64_t pipeline_parallel_layers_per_stage = 0;   // 0 = not set
  std::string pipeline_parallel_split_points;       // "layers.2,layers.4"; "" = not set

  bool operator==(const ParallelismConfig&) const = default;
};
const options::Section& parallelism_section();

// The section's degrees as ParallelDims takes them (dp_shard -1 still to resolve).
distributed::ParallelDegrees parallel_degrees(const ParallelismConfig& config);

}  // namespace loom::parallel
