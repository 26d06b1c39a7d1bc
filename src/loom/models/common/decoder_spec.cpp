#include "loom/models/common/decoder_spec.h"

#include "loom/models/common/adapter_dir.h"

#include <algorithm>

#include "loom/core/error.h"
#include "loom/models/common/model_dir.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/common/pipeline.h"

namespace loom::models {

const DecoderArgs& decoder_args_of(const ModelArgs& args, const std::string& family) {
  const auto* decoder = dynamic_cast<const DecoderArgs*>(&args);
  LOOM_REQUIRE(decoder != nullptr, family, "'s spec was given another model's args");
  return *decoder;
}

ModelSpec decoder_spec(DecoderFamily family) {
  auto f = std::make_shared<const DecoderFamily>(std::move(family));
  ModelSpec spec;
  spec.name = f->name;
  spec.flavors = f->flavors;
  spec.hf = f->hf;
  spec.build_args = [f](const ModelRequest& request) -> std::unique_ptr<ModelArgs> {
    std::unique_ptr<DecoderArgs> args = f->flavor(request.flavor, request.vocab_size);
    if (request.n_layers > 0) args->n_layers = request.n_layers;
    // The RoPE cache covers at least the training sequence.
    args->max_seq_len = std::max(args->max_seq_len, request.seq_len);
    args->validate();
    return args;
  };
  spec.build_model = [f](const ModelArgs& args, const torch::TensorOptions& options) {
    return std::static_pointer_cast<nn::Module>(f->build(decoder_args_of(args, f->name), options));
  };
  spec.count_parameters = [f](const ModelArgs& args) { return f->count_parameters(decoder_args_of(args, f->name)); };
  spec.flops_per_token = [f](const ModelArgs& args, int64_t seq_len) {
    const DecoderArgs& a = decoder_args_of(args, f->name);
    const ParameterCounts counts = f->count_parameters(a);
    return flops_per_token(a, counts.active - counts.embedding, seq_len);
  };
  spec.validate_layout = [f](const ModelArgs& args, const distributed::ParallelDims& dims, int64_t seq_len,
                             const TensorParallelOptions& tp, const PipelineOptions& pipeline) {
    const DecoderArgs& a = decoder_args_of(args, f->name);
    validate_tp_degree(a, dims.tp(), seq_len, tp);
    if (dims.pp_enabled()) validate_pipeline_layout(a, dims, pipeline);
    if (dims.ep_enabled()) {
      const int64_t experts = a.routed_experts();
      LOOM_REQUIRE_USAGE(experts > 0, "parallelism.expert_parallel_degree = ", dims.ep(),
                         " needs a Mixture-of-Experts model, but this ", f->name,
                         " model has no routed experts; set parallelism.expert_parallel_degree = 1");
      LOOM_REQUIRE_USAGE(experts % dims.ep() == 0, "parallelism.expert_parallel_degree ", dims.ep(),
                         " does not divide the ", experts, " routed experts of each MoE layer; pick a divisor of ",
                         experts);
    }
  };
  spec.parallelize = [f](std::shared_ptr<nn::Module> module, const ModelArgs& args,
                         const distributed::ParallelDims& dims, const distributed::DeviceMesh& mesh,
                         const ParallelizeOptions& options) -> std::unique_ptr<parallel::ParallelizedModel> {
    auto model = std::dynamic_pointer_cast<Decoder>(std::move(module));
    LOOM_REQUIRE(model != nullptr, f->name, "'s parallelize was given a model its spec did not build");
    PlanOptions plan = PlanOptions::from(options);
    // LoRA's targets are Hugging Face module names.
    if (f->hf) plan.lora_names = hf_module_names(*f->hf);
    // Pipeline parallelism first splits the model into this rank's stages (built afresh, so the
    // whole meta model is not needed).
    if (dims.pp_enabled()) {
      const DecoderArgs& a = decoder_args_of(args, f->name);
      const auto build_stage = [&f, &a] { return f->build(a, torch::TensorOptions().device(torch::kMeta)); };
      return pipeline_decoder(build_stage, dims, mesh, options.pipeline, f->tp_plan, plan);
    }
    return models::parallelize(std::move(model), dims, mesh, f->tp_plan, plan);
  };
  spec.model_config_json = [f](const ModelArgs& args) {
    return nlohmann::json{{"name", f->name}, {"model_args", f->args_to_json(decoder_args_of(args, f->name))}};
  };
  spec.model_args_from_config_json = [f](const nlohmann::json& model,
                                         const std::string& source) -> std::unique_ptr<ModelArgs> {
    LOOM_REQUIRE(model.is_object() && model.value("name", "") == f->name, "'", source, "' holds a '",
                 model.is_object() ? model.value("name", "") : model.dump(), "' model; this loader reads ", f->name);
    LOOM_REQUIRE(model.contains("model_args"), "'", source, "' has no model.model_args");
    return f->args_from_json(model.at("model_args"), source);
  };
  spec.read_initial_weights = [name = f->name](const std::filesystem::path& path) {
    return read_initial_weights(get_spec(name), path);
  };
  return spec;
}

}  // namespace loom::models
