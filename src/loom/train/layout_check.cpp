#include "loom/train/layout_check.h"

#include <sstream>
#include <string>

#include "loom/core/dtype.h"
#include "loom/parallel/optimizer_registry.h"
#include "loom/train/compatibility.h"

namespace loom::train {

models::TensorParallelOptions tensor_parallel_options(const JobConfig& config) {
  const auto& p = config.parallelism;
  return {!p.disable_sequence_parallel, !p.disable_loss_parallel, p.enable_async_tensor_parallel};
}

models::ParallelizeOptions parallelize_options(const JobConfig& config, const distributed::ParallelDims& dims,
                                               c10::Device device) {
  const auto& t = config.training;
  models::ParallelizeOptions options;
  options.tp = tensor_parallel_options(config);
  options.cp_rotate_method = config.parallelism.context_parallel_rotate_method;
  options.fsdp_reshard_after_forward = config.parallelism.fsdp_reshard_after_forward;
  options.fsdp_bucket_mb = config.parallelism.fsdp_bucket_mb;
  options.fsdp_prefetch_depth = config.parallelism.fsdp_prefetch_depth;
  options.fsdp_accumulate_unsharded = config.parallelism.fsdp_accumulate_unsharded;
  // What the optimizer needs FSDP's planner never to cut (its registry entry says).
  const parallel::OptimizerSpec& optimizer = parallel::optimizer_spec(config.optimizer.name);
  if (optimizer.fsdp_granularity) options.fsdp_parameter_granularity = optimizer.fsdp_granularity(config.optimizer.request());
  options.fsdp_mixed_precision.param_dtype = scalar_type(t.mixed_precision_param);
  options.fsdp_mixed_precision.reduce_dtype = scalar_type(t.mixed_precision_reduce);
  options.seed = static_cast<uint64_t>(t.seed);
  options.device = device;
  options.activation_checkpoint = config.activation_checkpoint;
  options.float8 = config.float8;
  options.lora = config.lora;
  options.pipeline = pipeline_options(config);
  if (!dims.fsdp_enabled() && options.fsdp_mixed_precision.param_dtype != torch::kFloat32) {
    // Without FSDP (one device, DDP, TP) mixed precision is autocast around the forward, as in
    // TorchTitan: float32 master weights, gradients and optimizer state (a bfloat16 reduce has
    // nothing to apply to: train/compatibility.cpp refuses it).
    options.autocast_dtype = options.fsdp_mixed_precision.param_dtype;
  }
  return options;
}

models::PipelineOptions pipeline_options(const JobConfig& config) {
  const auto& p = config.parallelism;
  models::PipelineOptions options;
  options.schedule = p.pipeline_parallel_schedule;
  options.schedule_csv = p.pipeline_parallel_schedule_csv;
  options.microbatch_size = p.pipeline_parallel_microbatch_size;
  options.microbatches = config.training.local_batch_size / p.pipeline_parallel_microbatch_size;
  options.seq_len = config.training.seq_len / p.context_parallel_degree;
  options.layers_per_stage = p.pipeline_parallel_layers_per_stage;
  options.fsdp_reshard_after_forward = p.fsdp_reshard_after_forward;
  // "layers.2, layers.5" -> {"layers.2", "layers.5"}
  std::stringstream points(p.pipeline_parallel_split_points);
  for (std::string point; std::getline(points, point, ',');) {
    point.erase(0, point.find_first_not_of(" \t"));
    point.erase(point.find_last_not_of(" \t") + 1);
    if (!point.empty()) options.split_points.push_back(point);
  }
  return options;
}

CheckedLayout check_layout(const JobConfig& config, int world_size, int rank, const models::ModelSpec& spec,
                           const std::function<const models::ModelArgs&()>& args) {
  validate(config);  // the world-independent checks (micro-batches per batch, CP chunks, ...)
  const distributed::ParallelDegrees degrees = parallel::parallel_degrees(config.parallelism);
  CheckedLayout out;
  out.dims = std::make_unique<distributed::ParallelDims>(degrees, world_size, rank);
  // The rows that need the resolved degrees.
  check_compatibility(config, out.dims.get());
  out.grad_accum_steps = gradient_accumulation_steps(config, out.dims->dp_degree());
  // Context parallel cuts each sequence into 2 x degree equal chunks (config validation checked
  // that it can); what is left per rank is what sequence parallel splits again.
  spec.validate_layout(args(), *out.dims, config.training.seq_len / config.parallelism.context_parallel_degree,
                       tensor_parallel_options(config), pipeline_options(config));
  return out;
}

}  // namespace loom::train
