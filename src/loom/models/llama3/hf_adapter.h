// Hugging Face `LlamaForCausalLM` <-> Loom Llama 3: config.json fields; the parameter names are
// the shared decoder's (models/common/hf_names.h), without QK-norm.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>

#include "loom/models/common/hf_names.h"
#include "loom/models/llama3/model_args.h"
#include "loom/models/spec.h"

namespace loom::llama3 {

struct HfLlamaConfig {
  ModelArgs args;  // max_seq_len = max_position_embeddings
  bool tie_word_embeddings = false;
};

// Reads a transformers Llama config (v4 `rope_theta` + `rope_scaling`, or v5 `rope_parameters`;
// rope types "default" and "llama3"). Anything Loom's model cannot represent (biases, another
// activation, head_dim != hidden_size / num_attention_heads, other RoPE types) is a one-line
// loom::Error naming `source`.
HfLlamaConfig hf_config_to_model_args(const nlohmann::json& config, const std::string& source);

// A config.json that transformers loads as LlamaForCausalLM (untied head, `torch_dtype` given).
nlohmann::json model_args_to_hf_config(const ModelArgs& args, const std::string& torch_dtype);

// Name mapping; nullopt for a name that is not a Llama weight (hf_to_loom also returns nullopt
// for the rotary `inv_freq` buffers old checkpoints carry, which callers skip).
inline std::optional<std::string> hf_to_loom_name(const std::string& hf_name) {
  return models::hf_to_loom_decoder_name(hf_name, /*qk_norm=*/false);
}
inline std::optional<std::string> loom_to_hf_name(const std::string& loom_name) {
  return models::loom_to_hf_decoder_name(loom_name, /*qk_norm=*/false);
}
using models::is_ignorable_hf_tensor;

// The above as the model spec's Hugging Face format ("llama"). A tied checkpoint (Llama 3.2 1B/3B)
// loads into Loom's untied head as a copy of the embedding.
models::HfFormat hf_format();

}  // namespace loom::llama3
