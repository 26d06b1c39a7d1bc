// DeepSeek-V3 as a registered model (models/spec.h): its decoder, flavors, initialization, counts
// (total and active), TP plan (MLA's up and output projections split by heads, its low-rank
// A projections and norms replicated) and Hugging Face format (DeepseekV3ForCausalLM: per-expert
// or fused expert tensors in, per-expert out; e_score_correction_bias <-> the selection bias;
// fp8 checkpoints with 128 x 128 block scales are dequantised on load).
#pragma once
#include <nlohmann/json_fwd.hpp>

#include "loom/models/common/tp_plan.h"
#include "loom/models/deepseek_v3/model.h"
#include "loom/models/spec.h"

namespace loom::deepseek_v3 {

models::ModelSpec model_spec();
const models::TPPlan& tp_plan();

models::HfFormat::Config hf_config_to_model_args(const nlohmann::json& config, const std::string& source);
nlohmann::json model_args_to_hf_config(const ModelArgs& args, const std::string& torch_dtype);

}  // namespace loom::deepseek_v3
