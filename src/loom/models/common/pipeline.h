// Splitting a decoder into pipeline stages, as TorchTitan's pipeline_llm / pipeline_module_split,
// for every family: from outside the model, which stays free of ranks. Each stage is the decoder
// built whole on the meta device and trimmed: it keeps only its layers (removed with
// layers().remove_module, so the others keep their ids and every parameter keeps its global name,
// as checkpoints need), stage 0 keeps tok_embeddings, the last stage keeps norm + output and
// computes the loss (Decoder::forward_part).
//
//   auto bounds = models::stage_layer_bounds(args, {pp, v, layers_per_stage, split_points});
//   auto parts = models::split_into_stages([&] { return family's decoder on meta; },
//                                          bounds, schedule.stages_of(pp_rank));
//   for (auto& m : parts) { m->to_empty(device); m->init_weights(seed); }  // whole-model values
//   auto stages = models::make_pipeline_stages(parts, stage_ids, schedule.num_stages());
//   pipeline::PipelineExecutor executor(schedule, stages, {pp_comm, {mb, seq, dim}});
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/ac/activation_checkpoint.h"
#include "loom/cp/ring_attention.h"
#include "loom/distributed/device_mesh.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/spec.h"
#include "loom/parallel/parallelized_model.h"
#include "loom/pipeline/schedule.h"
#include "loom/pipeline/stage.h"

namespace loom::models {

struct PipelineSplit {
  int pp = 1;               // parallelism.pipeline_parallel_degree
  int stages_per_rank = 1;  // v: the schedule's stages per rank
  // parallelism.pipeline_parallel_layers_per_stage; 0: not set.
  int64_t layers_per_stage = 0;
  // parallelism.pipeline_parallel_split_points: the first layer of every stage but the first, as
  // TorchTitan writes them ("layers.4") or bare ids ("4"); empty: not set.
  std::vector<std::string> split_points;
};

// Stage s of the pp × v stages holds layers [bounds[s], bounds[s + 1]) (bounds has pp × v + 1
// entries, 0 first, n_layers last). With neither option set the layers are split evenly, the first
// n_layers % (pp × v) stages taking one more. Every stage holds at least one layer. A split that
// cannot be made is a UsageError naming the numbers and the valid choices.
std::vector<int64_t> stage_layer_bounds(const DecoderArgs& args, const PipelineSplit& split);

// One trimmed model per stage in `stage_ids` (this rank's stages, schedule.stages_of(rank)).
// `build_model` builds the whole model (on the meta device, so building costs no memory); it is
// called once per stage.
std::vector<std::shared_ptr<Decoder>> split_into_stages(
    const std::function<std::shared_ptr<Decoder>()>& build_model,
    const std::vector<int64_t>& bounds, const std::vector<int>& stage_ids);

// The runtime stage of each model (forward = Decoder::forward_part, under autocast to
// `autocast` on `device` when set); models[i] is stage stage_ids[i] of num_stages.
std::vector<std::shared_ptr<pipeline::PipelineStage>> make_pipeline_stages(
    const std::vector<std::shared_ptr<Decoder>>& models, const std::vector<int>& stage_ids,
    int num_stages, pipeline::WeightGradMethod method = pipeline::WeightGradMethod::kPerOp,
    std::optional<c10::ScalarType> autocast = std::nullopt, c10::Device device = c10::kCPU);

// ---- The Trainer's entry points (TorchTitan's pipeline_llm) -----------------------------------

// The stage split and the lowered schedule for `pp` ranks as `options` ask (the schedule by name,
// or a CSV one, simulated so a deadlocking one is refused naming the action). The stages per rank
// follow from layers_per_stage or split_points when set, else the schedule's default. A split that
// cannot be made, or a schedule that cannot run these micro-batches, is a one-line UsageError.
// Pure: called before any process group exists, and again when building.
struct PipelinePlan {
  pipeline::Schedule schedule;
  std::vector<int64_t> layer_bounds;  // stage s holds layers [bounds[s], bounds[s + 1])
};
PipelinePlan plan_pipeline(const DecoderArgs& args, int pp, const PipelineOptions& options);
// plan_pipeline for the mesh's pp degree, refusing what the stages cannot compose with (a tied
// head, which would live on the first and last stage; FSDP re-gathering per micro-batch under a
// schedule that splits the backward). With FSDP the schedule gets its UNSHARD / REDUCE_GRAD /
// RESHARD actions (pipeline::add_fsdp_actions) unless it has them.
PipelinePlan validate_pipeline_layout(const DecoderArgs& args, const distributed::ParallelDims& dims,
                                      const PipelineOptions& options);

// This rank's stages of the split validate_pipeline_layout makes (the pp rank of `mesh`), each
// built by `build_model` on the meta device, given the whole model's composition (compose: TP by
// `tp_plan`, CP, AC, and FSDP with each stage its own root, driven by the schedule's actions), as
// a ParallelizedModel whose step runs the
// schedule over the "pp" group, each stage's forward under plan.autocast_dtype. Replicas without
// FSDP (dp_replicate) average gradients after the schedule. Under sequence parallelism the
// activations between stages are sequence-sharded.
std::unique_ptr<parallel::ParallelizedModel> pipeline_decoder(const std::function<std::shared_ptr<Decoder>()>& build_model,
                                                              const distributed::ParallelDims& dims,
                                                              const distributed::DeviceMesh& mesh,
                                                              const PipelineOptions& options, const TPPlan& tp_plan,
                                                              const PlanOptions& plan);

}  // namespace loom::models
