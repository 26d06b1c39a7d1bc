// Parallelizing a decoder, as TorchTitan's per-model parallelize_fn, written once for every family:
// one composition (Float8 -> TP -> CP -> AC -> FSDP/HSDP or materialization) applied to the whole
// model or to each of a pipeline rank's stages. What differs between families is data: the TP
// plan (tp_plan.h) and the initialization table (Decoder::parameter_init).
//
//   auto parts = models::compose({model}, dims, mesh, tp_plan, plan);   // parts of any decoder
//   auto parallel_model = models::parallelize(model, dims, mesh, tp_plan, plan);
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/ac/activation_checkpoint.h"
#include "loom/cp/ring_attention.h"
#include "loom/distributed/device_mesh.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/ep/expert_parallel.h"
#include "loom/float8/convert.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/tp_plan.h"
#include "loom/models/spec.h"
#include "loom/parallel/parallelized_model.h"

namespace loom::models {

// parallelism.fsdp_reshard_after_forward as TorchTitan reads it: "default" reshards every block
// but the last (backward needs it first, so re-gathering it would only cost an all-gather),
// "always" every block, "never" none, an integer N keeps a 1/N shard (hpZ) for every block.
struct FSDPReshardSetting {
  fsdp::ReshardAfterForward blocks = fsdp::ReshardAfterForward::always();
  bool last_block = false;  // whether the last block follows `blocks` (else it is kept unsharded)

  static FSDPReshardSetting parse(const std::string& text);
};

// The plan as the composition applies it, resolved from models::ParallelizeOptions.
struct PlanOptions {
  // Float8 linears (convert_to_float8), applied before everything else; nullopt = off.
  std::optional<float8::Float8Options> float8;
  // LoRA adapters on the targeted linears (after Float8, before any parallelism), the rest frozen;
  // nullopt = off. `lora_names` maps a linear's path to its HF module path (the targets' names).
  std::optional<lora::LoRAOptions> lora;
  lora::HfModuleName lora_names;
  // False for pipeline stages: the whole model's targets were checked before the split.
  bool lora_whole_model = true;
  TensorParallelOptions tp;               // when the mesh has "tp"
  cp::RotateMethod cp_rotate_method = cp::RotateMethod::kAllGather;  // when the mesh has "cp"
  ac::ACOptions ac;                       // activation checkpointing of the blocks (apply_ac)
  fsdp::FSDPPolicy fsdp;                  // when FSDP is on (dp_shard or cp > 1; HSDP with dp_replicate)
  bool fsdp_reshard_last_block = false;   // see FSDPReshardSetting
  int64_t fsdp_bucket_bytes = 0;          // FSDPGrouping::bucket_bytes (parallelism.fsdp_bucket_mb)
  bool fsdp_accumulate_unsharded = false; // FsdpSync: hold the gathered parameters across micro-batches
  // Autocast around the forward (mixed precision without FSDP); nullopt = full precision.
  std::optional<c10::ScalarType> autocast_dtype;
  uint64_t seed = 0;                      // initialization (the single-process values, any layout)
  c10::Device device = c10::kCPU;         // where parameters and buffers live

  // The run's settings (options as written, parsed here once) for `dims`.
  static PlanOptions from(const ParallelizeOptions& options);
};

// Context parallelism: every attention's core becomes ring attention over `comm` (the "cp" mesh
// dim); the model then takes this rank's head-tail chunks with their positions (prepare_batch).
void apply_cp(Decoder& model, tensor::CommPtr comm, cp::RotateMethod method);

// Activation checkpointing (TorchTitan's apply_ac): every block that `options` wraps (by layer
// id, so a pipeline stage, which keeps the whole model's ids, wraps the same blocks as the whole
// model) is checkpointed through its around-hook (ac::checkpoint_module). Applied after TP and CP,
// whose hooks inside the block are then re-run by the recompute, and before FSDP, whose hooks on
// the block sit outside it and run once per forward. Returns the number of blocks wrapped.
int64_t apply_ac(Decoder& model, const ac::ACOptions& options);

// How apply_fsdp groups a decoder's parameters beyond the policy.
struct FSDPGrouping {
  // Whether the last block group and the head follow the policy's reshard_after_forward; false keeps
  // them gathered after forward, as their backward comes first (TorchTitan's default).
  bool reshard_last_block = true;
  // Consecutive blocks merged into groups ("buckets") of about this many bytes of parameters
  // (fsdp::plan_buckets over the blocks' own parameters, in their dtype): one all-gather and one
  // reduce-scatter per bucket. 0 = one group per block.
  int64_t bucket_bytes = 0;
};

// parallelism.fsdp_bucket_mb in bytes: 0 stays 0 (off), kAutoBucketMb picks kAutoBucketBytes.
inline constexpr double kAutoBucketMb = -1;
// The automatic bucket: 25 MB, DDP's bucket_cap_mb, for the same reason -- large enough that a
// collective's fixed cost is small next to its transfer, small enough that a gathered bucket's
// memory and the exposed first gather stay small. Blocks of that size or more stay alone (the
// 124M model's 28 MB blocks); smaller ones are merged.
inline constexpr int64_t kAutoBucketBytes = 25LL << 20;
int64_t resolve_fsdp_bucket_mb(double bucket_mb);

// fully_shard on every block ("layers.<id>"), or on buckets of consecutive blocks (grouping's
// bucket_bytes); on the head, the final norm and output projection together (fully_shard([norm,
// output]) as TorchTitan, "head"), when the model has an untied output that the loss reaches through
// its hooks (no parallel style on it and no installed HeadLoss); then on the model (the root: the
// token embedding and whatever else is left). The head as its own group lets its reduce-scatter,
// the first gradients of the backward, overlap the blocks' backward instead of waiting for the
// embedding's, the last; the root's is then the only one nothing can hide. The policy's
// reshard_after_forward applies to every group; with reshard_last_block = false the last block
// group and the head keep their parameters. Parameter names are those of the model whatever the
// grouping. Returns the root FSDP handle: finalize_backward, zero_grad, unshard/reshard,
// full_state_dict, and the parameter groups for fsdp::ShardedAdamW.
std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Decoder& model, const distributed::DeviceMesh& mesh,
                                             const fsdp::FSDPPolicy& policy, const FSDPGrouping& grouping = {});
// Same with the FSDP groups already built (tests, or a caller that made the FSDPMesh itself).
std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Decoder& model, const fsdp::FSDPMesh& mesh,
                                             const fsdp::FSDPPolicy& policy, const FSDPGrouping& grouping = {});

// Initializes the sharded parameters exactly as init_weights(seed) would the whole model (each
// parameter drawn in full on the CPU on its own, this rank keeping its piece, so every device gets
// the same values), and materializes the model's non-persistent buffers (RoPE cache) on `device`,
// the rank's device (FSDPPolicy::device), if they are still on the meta device. FSDP shards the
// pieces other parallelisms left (TP, EP: their slots' layouts): each is cut from its parameter's
// whole value.
void init_sharded_weights(Decoder& model, fsdp::FSDPModule& fsdp, uint64_t seed,
                          c10::Device device = c10::Device(c10::kCPU));
// The same without FSDP: every parameter's piece of its slot's layout (the whole parameter when it
// has none), for a model already materialized on its device.
void init_placed_weights(Decoder& model, uint64_t seed);

// The one composition, applied to the model parts this rank holds (the whole model, or its
// pipeline stages), in TorchTitan's order: the Float8 conversion of the linears (float8 set; the
// model converters run first), tensor parallelism by `tp_plan` (tp > 1; one plan for every part),
// context parallelism (cp > 1), activation checkpointing (activation_checkpoint.mode), then FSDP
// over dp_shard (dp_shard x cp with context parallelism; HSDP with dp_replicate; one part only),
// else materialization on the device; every parameter initialized from the seed, each rank only
// its pieces. The parts are built on the meta device. Returns the parts' ParallelParts without the
// step's driver: the caller adds the forward (parallelize) or the pipeline (pipeline_decoder), and
// the replicas' gradient average (DDP in backward, or the pipeline's after the schedule).
parallel::ParallelParts compose(const std::vector<std::shared_ptr<Decoder>>& models,
                                const distributed::ParallelDims& dims, const distributed::DeviceMesh& mesh,
                                const TPPlan& tp_plan, const PlanOptions& options);

// compose() on the whole model, its forward_loss under autocast (options.autocast_dtype) as the
// step's forward, and DDP over dp_replicate without sharding. The result is what the Trainer
// drives.
std::unique_ptr<parallel::ParallelizedModel> parallelize(std::shared_ptr<Decoder> model,
                                                         const distributed::ParallelDims& dims,
                                                         const distributed::DeviceMesh& mesh, const TPPlan& tp_plan,
                                                         const PlanOptions& options);

}  // namespace loom::models
