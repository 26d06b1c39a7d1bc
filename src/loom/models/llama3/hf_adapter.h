// Hugging Face `LlamaForCausalLM` <-> Loom Llama 3: config.json fields and parameter names.
//
// No weight permutation is needed in either direction: Loom's RoPE uses the rotate-half pairing
// (loom/nn/rope.h) that Hugging Face checkpoints are stored in.
//
//   model.embed_tokens.weight                      tok_embeddings.weight
//   model.layers.N.input_layernorm.weight          layers.N.attention_norm.weight
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight layers.N.attention.w{q,k,v,o}.weight
//   model.layers.N.post_attention_layernorm.weight layers.N.ffn_norm.weight
//   model.layers.N.mlp.gate_proj.weight            layers.N.feed_forward.w1.weight
//   model.layers.N.mlp.down_proj.weight            layers.N.feed_forward.w2.weight
//   model.layers.N.mlp.up_proj.weight              layers.N.feed_forward.w3.weight
//   model.norm.weight                              norm.weight
//   lm_head.weight                                 output.weight
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>

#include "loom/models/llama3/model_args.h"

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
std::optional<std::string> hf_to_loom_name(const std::string& hf_name);
std::optional<std::string> loom_to_hf_name(const std::string& loom_name);
// True for tensors a Hugging Face checkpoint may hold that carry no weights (rotary caches).
bool is_ignorable_hf_tensor(const std::string& hf_name);

}  // namespace loom::llama3
