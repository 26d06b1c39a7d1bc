// GPT-OSS (OpenAI's gpt-oss-20b and gpt-oss-120b; transformers' GptOssForCausalLM) on the shared
// decoder. Every layer is a pre-norm MoETransformerBlock (models/common/moe_block.h) whose
//   attention  is grouped-query attention with biased projections and learned per-head sinks
//              (nn/attention.h), on a sliding window of `sliding_window` tokens in the layers
//              layer_types marks "sliding_attention" (the even layers of the published models)
//              and full causal in the others;
//   MoE        routes with a biased gate, takes the top_k logits and softmaxes them (GPT-OSS's
//              order), and runs experts with biases and the clamped SwiGLU (moe/moe.h).
// RoPE is YaRN (nn/rope.h) as transformers computes GPT-OSS's: factor 32 over 4096 original
// positions, beta 32/1, the correction range not truncated, cos/sin times 0.1 ln(factor) + 1.
// Names: the shared decoder's, with layers.<i>.attention.{wq,wk,wv,wo}.{weight,bias},
// layers.<i>.attention.sinks and layers.<i>.moe.{router.gate.{weight,bias}, experts.{w1,w2,w3,b1,b2,b3},
// expert_bias}.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/models/common/decoder.h"
#include "loom/models/common/moe_block.h"

namespace loom::gpt_oss {

struct ModelArgs : models::DecoderArgs {
  ModelArgs();  // gpt-oss-20b
  int64_t n_experts = 32;      // num_local_experts
  int64_t top_k = 4;           // num_experts_per_tok
  int64_t moe_ffn_dim = 2880;  // intermediate_size: each expert's hidden width
  // Layers whose attention is windowed (layer_types == "sliding_attention"); empty: the even
  // layers, transformers' default. The window: a query sees itself and sliding_window - 1 before.
  std::vector<int64_t> sliding_layers_list;
  bool default_sliding_layers = true;
  int64_t sliding_window = 128;
  bool attention_bias = true;
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;
  // YaRN (rope_type "yarn"); rope_factor 1: plain RoPE.
  double rope_factor = 32.0;
  int64_t original_seq_len = 4096;  // original_max_position_embeddings
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool rope_truncate = false;
  double rope_attention_factor = 0.0;  // > 0: transformers' attention_factor; 0: yarn_mscale(factor)
  // Auxiliary-loss-free balancing (moe::MoEOptions::load_balance_coeff): off in the published
  // recipe (and in what a Hugging Face config reads), so what trains exports exactly.
  double load_balance_coeff = 0.0;
  // TorchTitan's depth-scaled init: std 0.02 / sqrt(2 (layer_id + 1)).
  bool depth_init = true;

  bool is_sliding(int64_t layer_id) const;
  int64_t ffn_hidden_dim() const override { return moe_ffn_dim; }
  int64_t routed_experts() const override { return n_experts; }
  nn::AttentionOptions attention_options(int64_t layer_id) const override;
  torch::Tensor rope_cache_values() const override;
  double attention_factor() const;
  moe::MoEOptions moe_options() const;
  void validate() const override;
  std::string summary() const override;
};

// debugmodel (trains on the bundled data on a CPU), tiny (the layout-parity model), and the
// published 20B and 120B. `vocab_size` overrides the flavor's.
ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size = std::nullopt);
std::vector<std::string> flavor_names();

nlohmann::json to_json(const ModelArgs& args);
ModelArgs model_args_from_json(const nlohmann::json& json, const std::string& source);

// Parameter counts from the shapes: total (every weight, bias, sink), embedding, and active =
// what one token passes through (top_k of each layer's experts; both embedding tables counted).
models::ParameterCounts count_parameters(const ModelArgs& args);

class GptOss : public models::Decoder {
 public:
  explicit GptOss(ModelArgs args, const torch::TensorOptions& options = torch::TensorOptions());
  // TorchTitan's GPT-OSS initialisation: embedding normal(0.02); norms ones; every attention
  // weight, the sinks and every MoE weight and expert bias trunc_normal(std) with std =
  // 0.02 / sqrt(2 (layer_id + 1)) (cut at +-2); attention and router biases zeros; the output head
  // trunc_normal(dim^-0.5, +-3 std).
  nn::ParameterInit parameter_init(const std::string& name) const override;
  const ModelArgs& args() const { return args_; }

 private:
  const ModelArgs& args_;
};

}  // namespace loom::gpt_oss
