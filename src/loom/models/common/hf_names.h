// Hugging Face parameter names of the Llama-style decoders (LlamaForCausalLM, Qwen3ForCausalLM, and
// others with the same `model.layers.N.self_attn / mlp` layout) <-> the shared decoder's names.
//
//   model.embed_tokens.weight                      tok_embeddings.weight
//   model.layers.N.input_layernorm.weight          layers.N.attention_norm.weight
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight layers.N.attention.w{q,k,v,o}.weight
//   model.layers.N.self_attn.{q,k}_norm.weight     layers.N.attention.{q,k}_norm.weight (QK-norm)
//   model.layers.N.post_attention_layernorm.weight layers.N.ffn_norm.weight
//   model.layers.N.mlp.gate_proj.weight            layers.N.feed_forward.w1.weight
//   model.layers.N.mlp.down_proj.weight            layers.N.feed_forward.w2.weight
//   model.layers.N.mlp.up_proj.weight              layers.N.feed_forward.w3.weight
//   model.norm.weight                              norm.weight
//   lm_head.weight                                 output.weight (untied heads)
//
// No weight permutation is needed in either direction: Loom's RoPE uses the rotate-half pairing
// (loom/nn/rope.h) that Hugging Face checkpoints are stored in.
#pragma once
#include <optional>
#include <string>

namespace loom::models {

// nullopt for a name that is not such a weight (or a QK-norm weight when `qk_norm` is false).
std::optional<std::string> hf_to_loom_decoder_name(const std::string& hf_name, bool qk_norm);
std::optional<std::string> loom_to_hf_decoder_name(const std::string& loom_name, bool qk_norm);
// True for tensors a Hugging Face checkpoint may hold that carry no weights (rotary caches).
bool is_ignorable_hf_tensor(const std::string& hf_name);

}  // namespace loom::models
