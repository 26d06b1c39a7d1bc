// The optimizers a run can name (optimizer.name), each as data: how to build it over a model's
// trainable parameters or over FSDP's flat shards, what FSDP's planner must never cut for it, and
// which layouts it refuses. The Trainer, the config check and ParallelizedModel go through this
// table, so an optimizer is added here (plus its folder under optim/ and, sharded, fsdp/) and
// nowhere else. TorchTitan's build_optimizers plays the same part.
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loom/fsdp/fully_shard.h"
#include "loom/fsdp/sharded_optimizer.h"
#include "loom/optim/adamw.h"
#include "loom/optim/muon.h"
#include "loom/optim/optimizer.h"

namespace loom::parallel {

// optimizer.* as every optimizer reads it (each takes what it needs).
struct OptimizerRequest {
  optim::AdamWOptions adamw;  // AdamW, AdamW8bit, and Muon's non-matrix parameters
  optim::MuonOptions muon;
  double weight_decay = 0.0;
  int64_t block_size = 256;  // AdamW8bit's quantization block
};

// What a layout check needs to know of the run (all known before any process group).
struct OptimizerLayout {
  int64_t tensor_parallel_degree = 1;
  // training.device as configured: "cpu", "cuda" or "auto" (an "auto" that resolves to a GPU is
  // checked again when the optimizer is built, with the device itself).
  std::string device = "cpu";
  // A bfloat16 FSDP gather or reduce (training.mixed_precision_param or _reduce): FSDP's 16-byte
  // shard alignment is then 8 elements, not 4.
  bool half_precision_shards = false;
};

struct OptimizerSpec {
  std::string name;  // optimizer.name
  // A one-line loom::UsageError (exit 2) naming the setting and what would work when the request
  // or the layout is one this optimizer cannot run (unset: it runs in any).
  std::function<void(const OptimizerRequest&, const OptimizerLayout&)> check_layout;
  // What FSDP's planner must keep whole on one rank (FSDPPolicy::parameter_granularity); unset =
  // elements.
  std::function<fsdp::ParameterGranularity(const OptimizerRequest&)> fsdp_granularity;
  // Whether the optimizer applies a device-side optim::StepGuard (training.step_readback =
  // "log_steps" needs it).
  bool applies_step_guard = false;
  // Over this rank's trainable parameters (weight-decay groups by optim::weight_decay_param_groups).
  std::function<std::unique_ptr<optim::Optimizer>(const optim::NamedTensors&, const OptimizerRequest&)> build;
  // Over FSDP's flat shards (groups planned with fsdp_granularity).
  std::function<std::unique_ptr<fsdp::ShardedOptimizer>(fsdp::FSDPRoots, const OptimizerRequest&)>
      build_sharded;
};

// The registered spec named `name`; an unknown name is a loom::UsageError listing the registered ones.
const OptimizerSpec& optimizer_spec(std::string_view name);
// The registered names, in registration order (the config schema's choices for optimizer.name).
const std::vector<std::string_view>& optimizer_names();

}  // namespace loom::parallel
