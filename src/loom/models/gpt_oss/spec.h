// GPT-OSS as a registered model (models/spec.h): the decoder of model.h, its flavors,
// initialization, parameter counts (total and active), checkpoint entry, TP plan and Hugging Face
// format (GptOssForCausalLM): the experts' fused gate_up_proj [E, dim, 2 ffn] with interleaved
// gate/up columns and down_proj [E, ffn, dim] map to Loom's w1/w3/w2 (moe/experts.h); the published
// checkpoints' MXFP4 experts (`*_blocks` + `*_scales`) are dequantised on load (model_dir.h).
#pragma once
#include <nlohmann/json_fwd.hpp>

#include "loom/models/gpt_oss/model.h"
#include "loom/models/spec.h"

namespace loom::gpt_oss {

models::ModelSpec model_spec();

// config.json -> args: one line naming the field for what GPT-OSS in Loom cannot express.
models::HfFormat::Config hf_config_to_model_args(const nlohmann::json& config, const std::string& source);
nlohmann::json model_args_to_hf_config(const ModelArgs& args, const std::string& torch_dtype);

}  // namespace loom::gpt_oss
