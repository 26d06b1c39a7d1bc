// Qwen3 as a registered model (models/spec.h): the shared decoder with its flavors,
// initialization, TP plan, checkpoint entry and Hugging Face format (Qwen3ForCausalLM).
#pragma once
#include <nlohmann/json_fwd.hpp>

#include "loom/models/common/tp_plan.h"
#include "loom/models/qwen3/model.h"
#include "loom/models/spec.h"

namespace loom::qwen3 {

models::ModelSpec model_spec();

// The shared TransformerBlock plan (models::transformer_tp_plan), whose QK-norm rows apply here:
// replicated q_norm / k_norm, gradients summed over the group; the tied head is the embedding's
// vocabulary shard (loss parallel).
const models::TPPlan& tp_plan();

// transformers' Qwen3Config (v4 `rope_theta`, or v5 `rope_parameters`; rope type "default" only)
// -> Loom args; sliding windows, biases, other activations or RoPE scalings are a one-line
// loom::Error naming `source`.
models::HfFormat::Config hf_config_to_model_args(const nlohmann::json& config, const std::string& source);
nlohmann::json model_args_to_hf_config(const ModelArgs& args, const std::string& torch_dtype);

}  // namespace loom::qwen3
