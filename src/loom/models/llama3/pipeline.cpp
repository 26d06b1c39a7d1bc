#include "loom/models/llama3/pipeline.h"

#include <algorithm>

#include "loom/core/error.h"

namespace loom::llama3 {

namespace {

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

std::vector<int64_t> stage_layer_bounds(const ModelArgs& args, const PipelineSplit& split) {
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

std::vector<std::shared_ptr<Transformer>> split_into_stages(
    const std::function<std::shared_ptr<Transformer>()>& build_model,
    const std::vector<int64_t>& bounds, const std::vector<int>& stage_ids) {
  LOOM_REQUIRE(bounds.size() >= 2, "stage bounds need at least one stage");
  const int num_stages = static_cast<int>(bounds.size()) - 1;
  std::vector<std::shared_ptr<Transformer>> models;
  for (int stage : stage_ids) {
    LOOM_REQUIRE(stage >= 0 && stage < num_stages, "stage ", stage, " of ", num_stages);
    std::shared_ptr<Transformer> model = build_model();
    LOOM_REQUIRE(model != nullptr && bounds.back() == model->args().n_layers,
                 "stage bounds end at layer ", bounds.back(), " but the model has ",
                 model ? model->args().n_layers : 0, " layers");
    const int64_t first = bounds[stage], end = bounds[stage + 1];
    for (int64_t layer = 0; layer < model->args().n_layers; ++layer) {
      if (layer < first || layer >= end) model->layers().remove_module(std::to_string(layer));
    }
    if (stage != 0) model->remove_embedding();
    if (stage != num_stages - 1) model->remove_head();
    models.push_back(std::move(model));
  }
  return models;
}

std::vector<std::shared_ptr<pipeline::PipelineStage>> make_pipeline_stages(
    const std::vector<std::shared_ptr<Transformer>>& models, const std::vector<int>& stage_ids,
    int num_stages, pipeline::WeightGradMethod method) {
  LOOM_REQUIRE(models.size() == stage_ids.size(), models.size(), " stage models for ",
               stage_ids.size(), " stage ids");
  std::vector<std::shared_ptr<pipeline::PipelineStage>> stages;
  for (size_t i = 0; i < models.size(); ++i) {
    Transformer* model = models[i].get();
    LOOM_REQUIRE(model->has_embedding() == (stage_ids[i] == 0) &&
                     model->has_head() == (stage_ids[i] == num_stages - 1),
                 "stage ", stage_ids[i], " of ", num_stages,
                 ": the embedding belongs to stage 0 only and the head to the last stage only");
    auto forward = [model](const torch::Tensor& input, const torch::Tensor& labels) {
      return model->forward_part(input, labels);
    };
    // The fused loss reads output.weight without calling the module (and a hooked head would
    // switch it to whole logits), so the per-op weight gradient leaves the head to autograd.
    stages.push_back(std::make_shared<pipeline::PipelineStage>(
        stage_ids[i], num_stages, models[i], forward, method, std::vector<std::string>{"output"}));
  }
  return stages;
}

}  // namespace loom::llama3
