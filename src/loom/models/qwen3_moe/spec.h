// Qwen3-MoE as a registered model (models/spec.h): Qwen3's decoder with MoE blocks, its flavors,
// initialization, parameter counts (total and active), checkpoint entry and Hugging Face format
// (Qwen3MoeForCausalLM: per-expert keys, and transformers 5's fused gate_up_proj / down_proj).
#pragma once
#include <nlohmann/json_fwd.hpp>

#include "loom/models/qwen3_moe/model.h"
#include "loom/models/spec.h"

namespace loom::qwen3_moe {

models::ModelSpec model_spec();

models::HfFormat::Config hf_config_to_model_args(const nlohmann::json& config, const std::string& source);
nlohmann::json model_args_to_hf_config(const ModelArgs& args, const std::string& torch_dtype);

}  // namespace loom::qwen3_moe
