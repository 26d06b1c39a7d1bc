// The checks a run's parallel layout passes before any process group exists, as one function that
// `loom train` (the Trainer's step 1) and `loom plan` (every layout it emits) both call, so the
// planner can never propose what training would refuse: the config's own checks (validate), the
// degrees against the world size
// (distributed::ParallelDims), the settings that do not compose (check_compatibility), the
// global batch against the data-parallel degree (gradient_accumulation_steps) and the model's own
// shape rules (models::ModelSpec::validate_layout: heads and TP, layers and stages, schedules).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

#include "loom/distributed/parallel_dims.h"
#include "loom/models/spec.h"
#include "loom/train/config.h"

namespace loom::train {

// parallelism.disable_sequence_parallel / disable_loss_parallel / enable_async_tensor_parallel,
// as a model's plan reads them.
models::TensorParallelOptions tensor_parallel_options(const JobConfig& config);
// parallelism.pipeline_parallel_*, as a model's pipeline split reads them.
models::PipelineOptions pipeline_options(const JobConfig& config);
// Everything models::ModelSpec::parallelize reads from a job config ([parallelism], mixed
// precision, [activation_checkpoint], [float8], [lora], the seed) for a run of `dims` on `device`:
// the one composition the Trainer and `loom rl` both build their model with.
models::ParallelizeOptions parallelize_options(const JobConfig& config, const distributed::ParallelDims& dims,
                                               c10::Device device);

struct CheckedLayout {
  std::unique_ptr<distributed::ParallelDims> dims;
  int64_t grad_accum_steps = 1;
};

// Throws loom::UsageError (one line, exit 2) for the first check that fails, in this order: the
// config, the degrees against the world size, the compatibility rows, the global batch, then the
// model's rules. `spec` is models::get_spec(config.model.name); `args` returns its args at the
// run's vocabulary and seq_len, and is called only once the degrees passed (the Trainer reads the
// tokenizer there, so a world-size mistake is reported first; a planner passes args built once).
CheckedLayout check_layout(const JobConfig& config, int world_size, int rank, const models::ModelSpec& spec,
                           const std::function<const models::ModelArgs&()>& args);

}  // namespace loom::train
