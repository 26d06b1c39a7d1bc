#include "loom/models/common/pipeline.h"

#include <algorithm>

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/pipeline/executor.h"
#include "loom/pipeline/generators.h"
#include "loom/pipeline/simulator.h"
#include "loom/parallel/synchronizers.h"

namespace loom::models {

namespace {

// Whether FSDP inside the stages holds each stage gathered for the whole step.
bool holds_stages_gathered(const std::string& reshard_after_forward) {
  return reshard_after_forward == "default" || reshard_after_forward == "never" || reshard_after_forward == "false";
}

int64_t parse_split_point(const std::string& text, int64_t n_layers) {
  std::string id = text;
  if (id.rfind("layers.", 0) == 0) id = id.substr(7);
  const bool digits = !id.empty() && id.find_first_not_of("0123456789") == std::string::npos;
  LOOM_REQUIRE_USAGE(digits && id.size() < 10,
                     "parallelism.pipeline_parallel_split_points: '", text,
                     "' is not a layer (write 'layers.<id>' with id in 1 .. ", n_layers - 1, ")");
  return std::stoll(id);
}

}  // namespace

std::vector<int64_t> stage_layer_bounds(const DecoderArgs& args, const PipelineSplit& split) {
  LOOM_REQUIRE_USAGE(split.pp >= 1 && split.stages_per_rank >= 1,
                     "pipeline split needs pp >= 1 and stages per rank >= 1, got pp ", split.pp,
                     ", ", split.stages_per_rank);
  const int64_t n = args.n_layers;
  const int64_t stages = static_cast<int64_t>(split.pp) * split.stages_per_rank;
  const std::string stages_text = c10::str(stages, " stages (pipeline_parallel_degree ", split.pp,
                                           " x ", split.stages_per_rank, " stages per rank)");
  LOOM_REQUIRE_USAGE(split.layers_per_stage == 0 || split.split_points.empty(),
                     "set parallelism.pipeline_parallel_layers_per_stage or "
                     "parallelism.pipeline_parallel_split_points, not both");
  LOOM_REQUIRE_USAGE(n >= stages, "cannot split the model's ", n, " layers into ", stages_text,
                     ": every stage needs a layer; use at most ", n, " stages");
  std::vector<int64_t> bounds{0};
  if (!split.split_points.empty()) {
    LOOM_REQUIRE_USAGE(static_cast<int64_t>(split.split_points.size()) == stages - 1,
                       "parallelism.pipeline_parallel_split_points has ",
                       split.split_points.size(), " points; ", stages_text, " need ", stages - 1);
    for (const std::string& point : split.split_points) {
      const int64_t id = parse_split_point(point, n);
      LOOM_REQUIRE_USAGE(id > bounds.back() && id < n,
                         "parallelism.pipeline_parallel_split_points: '", point,
                         "' must come after the previous point (layer ", bounds.back(),
                         ") and before the last layer (", n - 1, "), in increasing order");
      bounds.push_back(id);
    }
  } else if (split.layers_per_stage > 0) {
    const int64_t per = split.layers_per_stage;
    if (per * stages != n) {
      const std::string valid =
          n % stages == 0 ? c10::str("valid: ", n / stages)
                          : c10::str("no value splits it: the layer count must be a multiple of ",
                                     stages, ", or set pipeline_parallel_split_points");
      // The stages per rank a schedule would need for the asked layers per stage.
      const std::string other =
          n % (per * split.pp) == 0
              ? c10::str(" (", per, " layers per stage needs ", n / (per * split.pp),
                         " stages per rank)")
              : std::string();
      LOOM_REQUIRE_USAGE(false, "parallelism.pipeline_parallel_layers_per_stage = ", per,
                         " does not split the model's ", n, " layers into ", stages_text, "; ",
                         valid, other);
    }
    for (int64_t s = 1; s < stages; ++s) bounds.push_back(s * per);
  } else {
    const int64_t base = n / stages, extra = n % stages;
    for (int64_t s = 0; s + 1 < stages; ++s) bounds.push_back(bounds.back() + base + (s < extra));
  }
  bounds.push_back(n);
  return bounds;
}

std::vector<std::shared_ptr<Decoder>> split_into_stages(
    const std::function<std::shared_ptr<Decoder>()>& build_model,
    const std::vector<int64_t>& bounds, const std::vector<int>& stage_ids) {
  LOOM_REQUIRE(bounds.size() >= 2, "stage bounds need at least one stage");
  const int num_stages = static_cast<int>(bounds.size()) - 1;
  std::vector<std::shared_ptr<Decoder>> models;
  for (int stage : stage_ids) {
    LOOM_REQUIRE(stage >= 0 && stage < num_stages, "stage ", stage, " of ", num_stages);
    std::shared_ptr<Decoder> model = build_model();
    LOOM_REQUIRE(model != nullptr && bounds.back() == model->decoder_args().n_layers,
                 "stage bounds end at layer ", bounds.back(), " but the model has ",
                 model ? model->decoder_args().n_layers : 0, " layers");
    const int64_t first = bounds[stage], end = bounds[stage + 1];
    for (int64_t layer = 0; layer < model->decoder_args().n_layers; ++layer) {
      if (layer < first || layer >= end) model->layers().remove_module(std::to_string(layer));
    }
    if (stage != 0) model->remove_embedding();
    if (stage != num_stages - 1) model->remove_head();
    models.push_back(std::move(model));
  }
  return models;
}

std::vector<std::shared_ptr<pipeline::PipelineStage>> make_pipeline_stages(
    const std::vector<std::shared_ptr<Decoder>>& models, const std::vector<int>& stage_ids,
    int num_stages, pipeline::WeightGradMethod method, std::optional<c10::ScalarType> autocast,
    c10::Device device) {
  LOOM_REQUIRE(models.size() == stage_ids.size(), models.size(), " stage models for ",
               stage_ids.size(), " stage ids");
  std::vector<std::shared_ptr<pipeline::PipelineStage>> stages;
  for (size_t i = 0; i < models.size(); ++i) {
    Decoder* model = models[i].get();
    LOOM_REQUIRE(model->has_embedding() == (stage_ids[i] == 0) &&
                     model->has_head() == (stage_ids[i] == num_stages - 1),
                 "stage ", stage_ids[i], " of ", num_stages,
                 ": the embedding belongs to stage 0 only and the head to the last stage only");
    auto forward = [model, autocast, device](const torch::Tensor& input, const torch::Tensor& labels,
                                             const nn::TokenLayout& layout) {
      // Autocast covers the forward only (the stage's backward runs each op in its forward's
      // dtype). The residual stream stays float32 under autocast, as the receive buffers expect.
      AutocastScope scope(device, autocast);
      return model->forward_part(input, labels, layout);
    };
    // The fused loss reads output.weight without calling the module (and a hooked head would
    // switch it to whole logits), so the per-op weight gradient leaves the head to autograd.
    stages.push_back(std::make_shared<pipeline::PipelineStage>(
        stage_ids[i], num_stages, models[i], forward, method, std::vector<std::string>{"output"}));
  }
  return stages;
}

PipelinePlan plan_pipeline(const DecoderArgs& args, int pp, const PipelineOptions& options) {
  LOOM_REQUIRE_USAGE(options.microbatches >= 1, "pipeline parallelism needs at least one micro-batch, got ",
                     options.microbatches);
  const int m = static_cast<int>(options.microbatches);
  const int64_t n = args.n_layers;
  PipelinePlan plan;
  if (!options.schedule_csv.empty()) {
    const std::string& path = options.schedule_csv;
    pipeline::Schedule s = pipeline::load_csv(path);
    LOOM_REQUIRE_USAGE(s.num_ranks == pp, "parallelism.pipeline_parallel_schedule_csv '", path, "' has ",
                       s.num_ranks, " rows (pipeline ranks) but pipeline_parallel_degree is ", pp,
                       "; write one row per rank");
    LOOM_REQUIRE_USAGE(s.num_microbatches == m, "parallelism.pipeline_parallel_schedule_csv '", path,
                       "' runs ", s.num_microbatches, " micro-batches but each batch has ", m,
                       " (training.local_batch_size / pipeline_parallel_microbatch_size)");
    // Compute-only rows get their send/recv placed (refused, naming the action, if they cannot
    // run); the simulator then proves the whole schedule runs to the end on every rank.
    if (!s.has_communication()) s = pipeline::add_communication(s);
    pipeline::simulate(s);
    plan.schedule = std::move(s);
  } else {
    int v = 0;  // the schedule's default
    if (options.layers_per_stage > 0) {
      const int64_t per = options.layers_per_stage;
      if (n % per != 0 || (n / per) % pp != 0) {
        std::string valid;
        for (int64_t d = 1; d <= n; ++d) {
          if (n % d == 0 && (n / d) % pp == 0) valid += c10::str(valid.empty() ? "" : ", ", d);
        }
        LOOM_REQUIRE_USAGE(false, "parallelism.pipeline_parallel_layers_per_stage = ", per, " does not cut the model's ",
                           n, " layers into a multiple of pipeline_parallel_degree ", pp, " stages; values that do: ",
                           valid.empty() ? std::string("none (use pipeline_parallel_split_points)") : valid);
      }
      v = static_cast<int>(n / per / pp);
    } else if (!options.split_points.empty()) {
      const int64_t stages = static_cast<int64_t>(options.split_points.size()) + 1;
      LOOM_REQUIRE_USAGE(stages % pp == 0, "parallelism.pipeline_parallel_split_points makes ", stages,
                         " stages, which is not a multiple of pipeline_parallel_degree ", pp);
      v = static_cast<int>(stages / pp);
    }
    if (v == 0) {
      // Too few layers for the schedule's default stages is refused before the schedule is
      // generated, with the message stage_layer_bounds gives after it (`loom plan` checks
      // thousands of layouts; generating a 128-rank schedule only to refuse it is most of that).
      const int default_v = pipeline::is_multi_stage(pipeline::canonical_schedule_name(options.schedule)) ? 2 : 1;
      if (n < static_cast<int64_t>(pp) * default_v) stage_layer_bounds(args, {pp, default_v, 0, {}});
    }
    plan.schedule = pipeline::build_schedule({options.schedule, pp, m, v});
  }
  plan.layer_bounds = stage_layer_bounds(
      args, {pp, plan.schedule.stages_per_rank, options.layers_per_stage, options.split_points});
  return plan;
}

PipelinePlan validate_pipeline_layout(const DecoderArgs& args, const distributed::ParallelDims& dims,
                                      const PipelineOptions& options) {
  LOOM_REQUIRE_USAGE(!args.tie_embeddings, "this model ties its output head to the token embedding, which pipeline "
                     "parallelism would place on the first and the last stage; set parallelism.pipeline_parallel_degree = 1 "
                     "(or train a flavor with an untied head)");
  PipelinePlan plan = plan_pipeline(args, dims.pp(), options);
  if (dims.fsdp_enabled()) {
    // FSDP inside the stages (over dp_shard, or dp_shard x cp with context parallelism) follows the
    // schedule: each stage is gathered at its UNSHARD, reduced at its REDUCE_GRAD (after its last
    // backward, so a zero-bubble split's weight gradients are in) and freed at its RESHARD.
    if (!plan.schedule.has_fsdp_actions()) plan.schedule = pipeline::add_fsdp_actions(plan.schedule);
    const bool per_micro_batch = !holds_stages_gathered(options.fsdp_reshard_after_forward);
    bool splits = false;
    for (const auto& row : plan.schedule.ranks) {
      for (const auto& a : row) splits = splits || a.kind == pipeline::ActionKind::kBackwardInput;
    }
    // A weight gradient (W) computed after the stage's parameters were freed by a later
    // micro-batch's forward would find no unsharded parameter to accumulate into.
    LOOM_REQUIRE_USAGE(!per_micro_batch || !splits, "parallelism.fsdp_reshard_after_forward = \"",
                       options.fsdp_reshard_after_forward, "\" re-gathers each stage for every micro-batch, which ",
                       "pipeline schedule '", plan.schedule.name, "' cannot do: it splits the backward into input ",
                       "and weight passes; set fsdp_reshard_after_forward = \"default\" (each stage gathered ",
                       "once per step)");
  }
  return plan;
}

std::unique_ptr<parallel::ParallelizedModel> pipeline_decoder(const std::function<std::shared_ptr<Decoder>()>& build_model,
                                                              const distributed::ParallelDims& dims,
                                                              const distributed::DeviceMesh& mesh,
                                                              const PipelineOptions& options, const TPPlan& tp_plan,
                                                              const PlanOptions& plan_options) {
  // The whole model on the meta device, for its args (the stages are built afresh below).
  const std::shared_ptr<Decoder> whole = build_model();
  const DecoderArgs& args = whole->decoder_args();
  const PipelinePlan plan = validate_pipeline_layout(args, dims, options);
  const tensor::CommPtr pp_comm = mesh.comm("pp");
  const std::vector<int> stage_ids = plan.schedule.stages_of(pp_comm->rank());
  auto models = split_into_stages(build_model, plan.layer_bounds, stage_ids);
  // The stages get the whole model's composition (Float8, TP, CP, AC, FSDP with each stage its own
  // root), before they hook their layers for the weight-gradient split.
  parallel::ParallelParts parts = compose(models, dims, mesh, tp_plan, plan_options);
  // FSDP inside the stages: the schedule's actions gather, reduce and free each stage (its own
  // root); the hooks only wait for the gathers and accumulate the micro-batches' gradients
  // unsharded. Held: gathered from UNSHARD to RESHARD across every micro-batch (one all-gather
  // and one reduce-scatter per group per step); else re-gathered for each micro-batch's forward
  // and backward.
  if (dims.fsdp_enabled()) {
    const bool hold = holds_stages_gathered(options.fsdp_reshard_after_forward);
    for (const auto& model : models) {
      const auto root = fsdp::fsdp_state(*model);
      LOOM_REQUIRE(root != nullptr && root->is_root(), "pipeline stage without its FSDP root");
      root->set_requires_gradient_sync(false);
      if (hold) {
        root->set_reshard_after_forward(false);
        root->set_reshard_after_backward(false);
      }
    }
  }
  const bool tp = dims.tp_enabled();
  const ac::ACOptions& ac = plan_options.ac;
  const auto& tp_options = plan_options.tp;
  const c10::Device device = plan_options.device;
  // The per-op weight gradient recomputes each layer's dW from its kept input and output, which
  // under tensor parallelism are not what the layer's local weight saw (sequence-parallel
  // gathers and scatters sit between them); there the I/W split goes through autograd.
  // With activation checkpointing too: a checkpointed block's layers run without autograd in
  // forward, so the per-op split captures none of them and W would never compute their weight
  // gradients (they are outputs of the checkpoint function, which only an autograd W asks for).
  const auto method = tp || ac.mode != ac::Mode::kNone ? pipeline::WeightGradMethod::kAutograd
                                                       : pipeline::WeightGradMethod::kPerOp;
  auto stages = make_pipeline_stages(models, stage_ids, plan.schedule.num_stages(), method,
                                     plan_options.autocast_dtype, device);
  pipeline::ExecutorOptions executor;
  executor.comm = pp_comm;
  // Under sequence parallelism the residual stream between blocks, and so between stages, is this
  // rank's 1/tp of the sequence.
  // options.seq_len is already this rank's length under context parallelism (2 of the 2c chunks).
  const int64_t seq = tp && tp_options.sequence_parallel ? options.seq_len / dims.tp() : options.seq_len;
  executor.activation_shape = {options.microbatch_size, seq, args.dim};
  executor.activation_dtype = c10::kFloat;
  executor.device = device;
  if (dims.fsdp_enabled()) {
    executor.unshard = [](pipeline::PipelineStage& stage) { fsdp::fsdp_state(stage.module())->unshard_async(); };
    executor.reshard = [](pipeline::PipelineStage& stage) { fsdp::fsdp_state(stage.module())->reshard(); };
    executor.reduce_grad = [](pipeline::PipelineStage& stage) {
      fsdp::fsdp_state(stage.module())->reduce_gradients();
    };
  }
  auto pipeline_executor = std::make_shared<pipeline::PipelineExecutor>(plan.schedule, stages, executor);
  parts.step = std::make_unique<parallel::PipelineStep>(pipeline_executor, options.microbatch_size);
  // Replicas without FSDP average gradients after the schedule (HSDP's: FSDP all-reduces over
  // dp_replicate itself).
  if (dims.dp_replicate_enabled() && !dims.fsdp_enabled()) {
    parts.synchronizers.push_back(std::make_shared<parallel::ReplicaAverageSync>(mesh.comm("dp_replicate")));
  }
  parts.synchronizers.push_back(std::make_shared<parallel::PipelineSync>(pipeline_executor, pp_comm, options.microbatch_size));
  return std::make_unique<parallel::ParallelizedModel>(std::move(parts));
}

}  // namespace loom::models
