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
#include <torch/torch.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/models/spec.h"

namespace loom::models {

// nullopt for a name that is not such a weight (or a QK-norm weight when `qk_norm` is false).
std::optional<std::string> hf_to_loom_decoder_name(const std::string& hf_name, bool qk_norm);
std::optional<std::string> loom_to_hf_decoder_name(const std::string& loom_name, bool qk_norm);
// True for tensors a Hugging Face checkpoint may hold that carry no weights (rotary caches).
bool is_ignorable_hf_tensor(const std::string& hf_name);

// The routed experts of HF MoE checkpoints (Qwen3-MoE, DeepSeek-V3 and their kin) as pieces of
// Loom's stacked experts: per-expert `model.layers.<i>.mlp.experts.<j>.{gate,up,down}_proj.weight`
// fill row j of `layers.<i>.moe.experts.{w1,w3,w2}`; transformers 5's fused `mlp.experts.gate_up_proj`
// [E, 2F, D] (gate rows first) and `mlp.experts.down_proj` fill them whole. Empty for other names.
std::vector<HfFormat::Piece> hf_expert_pieces(const std::string& hf_name, c10::IntArrayRef shape);
// `layers.<i>.moe.experts.{w1,w2,w3}` as per-expert HF tensors (what save_pretrained writes);
// nullopt for other names.
std::optional<std::vector<std::pair<std::string, torch::Tensor>>> experts_to_hf_tensors(const std::string& loom_name,
                                                                                       const torch::Tensor& value);

}  // namespace loom::models
