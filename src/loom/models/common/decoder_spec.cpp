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

namespace {
// model.flavor = "hf": the shape of request.hf_config, read by the family's Hugging Face reader (the
// one `loom score` and `convert` use), which must be this family's.
std::unique_ptr<DecoderArgs> hf_flavor_args(const DecoderFamily& f, const ModelRequest& request) {
  LOOM_REQUIRE_USAGE(f.hf.has_value(), "model.flavor = \"", kHfFlavor, "\": ", f.name,
                     " has no Hugging Face format to read a shape from; pick one of its flavors");
  LOOM_REQUIRE_USAGE(!request.hf_config.empty(), "model.flavor = \"", kHfFlavor,
                     "\" needs a config.json: set model.hf_config, or checkpoint.initial_load_path to a Hugging Face "
                     "model directory");
  const std::string source = request.hf_config.string();
  ModelDirArgs read = read_hf_config(request.hf_config);
  LOOM_REQUIRE_USAGE(read.spec->name == f.name, "'", source, "' describes a ", read.spec->name,
                     " model (its model_type) but model.name is \"", f.name, "\"; set model.name = \"",
                     read.spec->name, "\" to train it");
  auto* decoder = dynamic_cast<DecoderArgs*>(read.args.get());
  LOOM_REQUIRE(decoder != nullptr, f.name, "'s Hugging Face reader made no decoder args");
  std::unique_ptr<DecoderArgs> args(decoder);
  read.args.release();
  LOOM_REQUIRE_USAGE(request.vocab_size <= 0 || request.vocab_size == args->vocab_size, "model.vocab_size ",
                     request.vocab_size, " differs from the vocab_size ", args->vocab_size, " of '", source,
                     "', which model.flavor = \"", kHfFlavor, "\" trains; set model.vocab_size = 0");
  LOOM_REQUIRE_USAGE(request.min_vocab_size <= args->vocab_size, "the tokenizer's vocabulary (",
                     request.min_vocab_size, " ids) does not fit the vocab_size ", args->vocab_size, " of '", source,
                     "'; set model.tokenizer_path to the tokenizer of that model");
  LOOM_REQUIRE_USAGE(request.n_layers <= 0 || request.n_layers == args->n_layers, "model.n_layers ",
                     request.n_layers, " differs from the num_hidden_layers ", args->n_layers, " of '", source,
                     "', which model.flavor = \"", kHfFlavor, "\" trains; set model.n_layers = 0");
  return args;
}
}  // namespace

ModelSpec decoder_spec(DecoderFamily family) {
  auto f = std::make_shared<const DecoderFamily>(std::move(family));
  ModelSpec spec;
  spec.name = f->name;
  spec.flavors = f->flavors;
  spec.hf = f->hf;
  spec.build_args = [f](const ModelRequest& request) -> std::unique_ptr<ModelArgs> {
    if (request.flavor == kHfFlavor) {
      std::unique_ptr<DecoderArgs> args = hf_flavor_args(*f, request);
      args->max_seq_len = std::max(args->max_seq_len, request.seq_len);
      args->validate();
      return args;
    }
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
      // A stage holds some layers only: LoRA's targets are checked on the whole (meta) model, the
      // same on every rank, and each stage adapts what it has of them.
      if (plan.lora) {
        lora::check_lora_targets(*model, *plan.lora, plan.lora_names);
        plan.lora_whole_model = false;
      }
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
