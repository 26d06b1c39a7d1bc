#include "loom/train/compatibility.h"

#include "loom/core/error.h"
#include "loom/parallel/optimizer_registry.h"

namespace loom::train {

const std::vector<Incompatibility>& incompatibilities() {
  using Dims = const distributed::ParallelDims*;
  static const std::vector<Incompatibility> table = {
      {"parallelism.enable_async_tensor_parallel", "parallelism.disable_sequence_parallel",
       [](const JobConfig& c, Dims) {
         return c.parallelism.enable_async_tensor_parallel && c.parallelism.disable_sequence_parallel;
       },
       false,
       [](const JobConfig&) {
         return std::string("parallelism.enable_async_tensor_parallel needs sequence parallelism (it overlaps the "
                            "sequence all-gathers and reduce-scatters); set parallelism.disable_sequence_parallel = false");
       }},
      // Async TP replaces the linears' around-hooks (Float8's) with its collective matmuls.
      {"float8.enable", "parallelism.enable_async_tensor_parallel",
       [](const JobConfig& c, Dims) {
         return c.float8.enable && c.parallelism.enable_async_tensor_parallel && c.parallelism.tensor_parallel_degree > 1;
       },
       false,
       [](const JobConfig&) {
         return std::string("float8.enable = true does not compose with parallelism.enable_async_tensor_parallel (its "
                            "collective matmuls replace the float8 linears); set enable_async_tensor_parallel = false");
       }},
      {"validation.enable", "pipeline parallelism",
       [](const JobConfig& c, Dims) { return c.validation.enable && c.parallelism.pipeline_parallel_degree > 1; },
       false,
       [](const JobConfig& c) {
         return c10::str("validation.enable = true is not supported with pipeline parallelism "
                         "(parallelism.pipeline_parallel_degree = ", c.parallelism.pipeline_parallel_degree,
                         "): the pipeline schedules run forward and backward together; set "
                         "validation.enable = false or score the checkpoints with `loom score`");
       }},
      // A schedule CSV is read only by a pipeline: with one pipeline rank it would be silently ignored.
      {"parallelism.pipeline_parallel_schedule_csv", "pipeline_parallel_degree = 1",
       [](const JobConfig& c, Dims) {
         return !c.parallelism.pipeline_parallel_schedule_csv.empty() && c.parallelism.pipeline_parallel_degree == 1;
       },
       false,
       [](const JobConfig& c) {
         return c10::str("parallelism.pipeline_parallel_schedule_csv = '", c.parallelism.pipeline_parallel_schedule_csv,
                         "' needs pipeline parallelism, but parallelism.pipeline_parallel_degree = ",
                         c.parallelism.pipeline_parallel_degree,
                         "; set the degree to the CSV's number of rows, or leave the CSV unset");
       }},
      // Tokens must be split over the tp ranks before dispatch (each rank routes its own): without
      // sequence parallelism every tp rank would send the same tokens to the experts.
      {"parallelism.expert_parallel_degree > 1", "tensor parallelism without sequence parallelism",
       [](const JobConfig& c, Dims) {
         return c.parallelism.expert_parallel_degree > 1 && c.parallelism.tensor_parallel_degree > 1 &&
                c.parallelism.disable_sequence_parallel;
       },
       false,
       [](const JobConfig& c) {
         return c10::str("parallelism.expert_parallel_degree = ", c.parallelism.expert_parallel_degree,
                         " with tensor parallelism needs sequence parallelism (each tp rank dispatches its own "
                         "tokens); set parallelism.disable_sequence_parallel = false");
       }},
      // Without FSDP nothing reduces the experts' gradients over ranks outside the ep group.
      {"parallelism.expert_parallel_degree", "no FSDP, unless it equals the TP degree",
       [](const JobConfig& c, Dims dims) {
         return dims != nullptr && dims->ep_enabled() && !dims->fsdp_enabled() && dims->ep() != dims->tp();
       },
       true,
       [](const JobConfig& c) {
         return c10::str("parallelism.expert_parallel_degree = ", c.parallelism.expert_parallel_degree,
                         " without FSDP (data_parallel_shard_degree = context_parallel_degree = 1) must equal "
                         "tensor_parallel_degree = ", c.parallelism.tensor_parallel_degree,
                         "; set it to the TP degree or shard the data-parallel ranks (data_parallel_shard_degree > 1)");
       }},
      // Async TP replaces the linears' forward with collective matmuls, which know no adapter.
      {"lora.rank > 0", "parallelism.enable_async_tensor_parallel",
       [](const JobConfig& c, Dims) { return c.lora.rank > 0 && c.parallelism.enable_async_tensor_parallel; }, false,
       [](const JobConfig&) {
         return std::string("lora.rank > 0 does not compose with parallelism.enable_async_tensor_parallel (its collective "
                            "matmuls replace the adapted linears); set enable_async_tensor_parallel = false");
       }},
      // The recompute would draw another dropout mask than the forward did.
      {"lora.dropout > 0", "activation checkpointing",
       [](const JobConfig& c, Dims) {
         return c.lora.rank > 0 && c.lora.dropout > 0 && c.activation_checkpoint.mode != ac::Mode::kNone;
       },
       false,
       [](const JobConfig& c) {
         return c10::str("lora.dropout = ", c.lora.dropout, " does not compose with activation checkpointing (its "
                         "recompute would draw another mask); set lora.dropout = 0 or activation_checkpoint.mode = \"none\"");
       }},
      // Only an optimizer whose update takes the device-side guard (optim::StepGuard).
      {"training.step_readback = \"log_steps\"", "an optimizer without a device-side step guard",
       [](const JobConfig& c, Dims) {
         return c.training.step_readback == StepReadback::kLogSteps && !parallel::optimizer_spec(c.optimizer.name).applies_step_guard;
       },
       false,
       [](const JobConfig& c) {
         return c10::str("config key 'training.step_readback' must be \"every_step\" or \"auto\" with optimizer.name = \"",
                         c.optimizer.name, "\" (\"log_steps\" needs AdamW), got \"",
                         options::enum_name(c.training.step_readback), "\"");
       }},
      // Without FSDP (one device, DDP, TP) mixed precision is autocast around the forward, as in
      // TorchTitan: float32 master weights, gradients and optimizer state; DDP all-reduces the
      // float32 gradients, so a bfloat16 reduce has nothing to apply to.
      {"training.mixed_precision_reduce = \"bfloat16\"", "no FSDP",
       [](const JobConfig& c, Dims dims) {
         return dims != nullptr && c.training.mixed_precision_reduce != Precision::kFloat32 && !dims->fsdp_enabled();
       },
       true,
       [](const JobConfig& c) {
         return c10::str("training.mixed_precision_reduce = \"", options::enum_name(c.training.mixed_precision_reduce),
                         "\" needs FSDP (parallelism.data_parallel_shard_degree > 1): without it gradients are "
                         "float32 master-weight gradients; set it to \"float32\"");
       }},
      // A smaller data-parallel degree would not divide the experts over the same ranks.
      {"fault_tolerance.enable", "parallelism.expert_parallel_degree > 1",
       [](const JobConfig& c, Dims) { return c.fault_tolerance.enable && c.parallelism.expert_parallel_degree > 1; },
       false,
       [](const JobConfig& c) {
         return c10::str("fault_tolerance.enable = true does not compose with parallelism.expert_parallel_degree = ",
                         c.parallelism.expert_parallel_degree, " (a smaller membership would not divide the experts); "
                         "set fault_tolerance.enable = false and rely on --max-restarts");
       }},
      // The optimizer update must be local to each rank: one cut short by a lost peer (distributed
      // Muon's gathers run inside it) would leave a torn state that no copy can repair.
      {"fault_tolerance.enable", "optimizer.name = \"Muon\"",
       [](const JobConfig& c, Dims) {
         return c.fault_tolerance.enable && parallel::optimizer_spec(c.optimizer.name).name == "Muon";
       },
       false,
       [](const JobConfig&) {
         return std::string("fault_tolerance.enable = true does not compose with optimizer.name = \"Muon\" (its "
                            "sharded update gathers across ranks, and one cut short by a lost rank cannot be "
                            "repaired); use AdamW or AdamW8bit, or set fault_tolerance.enable = false");
       }},
  };
  return table;
}

void check_compatibility(const JobConfig& config, const distributed::ParallelDims* dims) {
  for (const Incompatibility& row : incompatibilities()) {
    if ((dims != nullptr || !row.needs_dims) && row.applies(config, dims)) fail_usage(row.message(config));
  }
}

std::string compatibility_markdown() {
  std::string out =
      "## Settings that do not compose\n\n"
      "Checked before any process group exists (src/loom/train/compatibility.cpp); each is a one-line error "
      "with exit code 2. An optimizer's own refusals are in its registry entry, a model's shape rules "
      "(e.g. a TP degree that does not divide the heads) in its spec.\n\n"
      "| setting | does not compose with |\n| --- | --- |\n";
  for (const Incompatibility& row : incompatibilities()) out += c10::str("| `", row.first, "` | ", row.second, " |\n");
  return out + "\n";
}

}  // namespace loom::train
