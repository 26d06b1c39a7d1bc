#include "loom/models/llama3/spec.h"

#include <algorithm>

#include "loom/core/error.h"
#include "loom/models/llama3/model.h"
#include "loom/models/llama3/model_dir.h"
#include "loom/models/llama3/parallelize.h"
#include "loom/models/llama3/pipeline.h"

namespace loom::llama3 {
namespace {

std::unique_ptr<models::ModelArgs> build_args(const models::ModelRequest& request) {
  auto args = std::make_unique<ModelArgs>(flavor(request.flavor, request.vocab_size));
  if (request.n_layers > 0) args->n_layers = request.n_layers;
  // The RoPE cache covers at least the training sequence.
  args->max_seq_len = std::max(args->max_seq_len, request.seq_len);
  return args;
}

// Float8 composes with FSDP and DDP only. Row-wise scales of a rowwise-parallel weight (sharded
// along in_features) would be taken on a slice of each row, and async TP replaces the linears'
// around-hooks: refused, not emulated.
void check_float8_layout(const distributed::ParallelDims& dims) {
  LOOM_REQUIRE_USAGE(!dims.tp_enabled(), "float8.enable = true does not support tensor parallelism yet "
                     "(tensor_parallel_degree = ", dims.tp(), "); set parallelism.tensor_parallel_degree = 1 "
                     "(FSDP and DDP work with float8) or float8.enable = false");
  LOOM_REQUIRE_USAGE(!dims.pp_enabled(), "float8.enable = true does not support pipeline parallelism yet "
                     "(pipeline_parallel_degree = ", dims.pp(), "); set parallelism.pipeline_parallel_degree = 1 "
                     "or float8.enable = false");
}

std::unique_ptr<parallel::ParallelizedModel> parallelize_model(
    std::shared_ptr<nn::Module> module, const models::ModelArgs& /*args*/,
    const distributed::ParallelDims& dims, const distributed::DeviceMesh& mesh,
    const models::ParallelizeOptions& options) {
  auto model = std::dynamic_pointer_cast<Transformer>(std::move(module));
  LOOM_REQUIRE(model != nullptr, "llama3's parallelize was given a model its spec did not build");
  PlanOptions plan;
  plan.tp = options.tp;
  plan.cp_rotate_method = cp::parse_rotate_method(options.cp_rotate_method);
  const auto reshard = FSDPReshardSetting::parse(options.fsdp_reshard_after_forward);
  plan.fsdp.reshard_after_forward = reshard.blocks;
  plan.fsdp_reshard_last_block = reshard.last_block;
  plan.fsdp.mixed_precision = options.fsdp_mixed_precision;
  plan.fsdp.parameter_granularity = options.fsdp_parameter_granularity;
  plan.fsdp.device = options.device;  // FSDP's buffers on the rank's device (caching allocator on GPUs)
  plan.ac = ac::ACOptions::parse(options.activation_checkpoint_mode, options.selective_ac_option);
  if (options.float8) {
    check_float8_layout(dims);  // validate_layout did, before rendezvous; direct callers too
    plan.float8 = float8::Float8Options::parse(options.float8_recipe, options.float8_filter_fqns);
  }
  plan.seed = options.seed;
  plan.device = options.device;
  plan.autocast_dtype = options.autocast_dtype;
  // Pipeline parallelism first splits the model into this rank's stages (built afresh, so the
  // whole meta model is not needed).
  if (dims.pp_enabled()) {
    return pipeline_llama(model->args(), dims, mesh, options.pipeline, plan);
  }
  return parallelize(std::move(model), dims, mesh, plan);
}

models::InitialWeights read_initial_weights(const std::filesystem::path& path) {
  models::InitialWeights weights;
  if (detect_model_dir_format(path) == ModelDirFormat::kLoom) {
    weights.loom_checkpoint = resolve_loom_checkpoint(path);
    return weights;
  }
  const auto model = load_hf_model_dir(path);
  for (const auto& p : model->named_parameters()) weights.full_parameters[p.name] = p.tensor().detach();
  return weights;
}

}  // namespace

const ModelArgs& args_of(const models::ModelArgs& args) {
  const auto* llama = dynamic_cast<const ModelArgs*>(&args);
  LOOM_REQUIRE(llama != nullptr, "llama3's spec was given another model's args");
  return *llama;
}

models::ModelSpec model_spec() {
  models::ModelSpec spec;
  spec.name = "llama3";
  spec.flavors = flavor_names();
  spec.build_args = build_args;
  spec.build_model = [](const models::ModelArgs& args, const torch::TensorOptions& options) {
    return std::static_pointer_cast<nn::Module>(std::make_shared<Transformer>(args_of(args), options));
  };
  spec.count_parameters = [](const models::ModelArgs& args) { return count_parameters(args_of(args)); };
  spec.flops_per_token = [](const models::ModelArgs& args, int64_t seq_len) {
    const ModelArgs& a = args_of(args);
    return flops_per_token(a, count_parameters(a).non_embedding, seq_len);
  };
  spec.validate_layout = [](const models::ModelArgs& args, const distributed::ParallelDims& dims,
                            int64_t seq_len, const models::TensorParallelOptions& tp,
                            const models::PipelineOptions& pipeline, bool float8) {
    if (float8) check_float8_layout(dims);
    validate_tp_degree(args_of(args), dims.tp(), seq_len, tp);
    if (dims.pp_enabled()) validate_pipeline_layout(args_of(args), dims, pipeline);
  };
  spec.parallelize = parallelize_model;
  spec.model_config_json = [](const models::ModelArgs& args) { return model_config_json(args_of(args)); };
  spec.model_args_from_config_json = [](const nlohmann::json& json, const std::string& source) {
    return std::unique_ptr<models::ModelArgs>(
        std::make_unique<ModelArgs>(model_args_from_config_json(json, source)));
  };
  spec.read_initial_weights = read_initial_weights;
  return spec;
}

}  // namespace loom::llama3
