// Qwen3 (dense): the shared decoder (models/common/decoder.h) with TransformerBlocks whose
// attention has QK-norm (an RMSNorm over head_dim on every query and key head, before RoPE), a
// head width stated rather than derived (head_dim != dim / n_heads), RoPE theta 1e6 without
// scaling, norm eps 1e-6, and, in the small flavors, the output head tied to the token embedding.
// Module and parameter names are the shared decoder's: tok_embeddings, layers.{i}.{attention_norm,
// attention.{wq,wk,wv,wo,q_norm,k_norm}, ffn_norm, feed_forward.{w1,w2,w3}}, norm, output (absent
// when tied).
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/models/common/decoder.h"

namespace loom::qwen3 {

struct ModelArgs : models::DecoderArgs {
  ModelArgs();
  int64_t ffn_dim = 3072;  // intermediate_size
  // TorchTitan's depth-scaled init of wo/w2/w3 (see parameter_init).
  bool depth_init = true;

  int64_t ffn_hidden_dim() const override { return ffn_dim; }
  std::string summary() const override;  // "dim 1024, 28 layers, 16 heads (8 kv) x 128, ffn 3072, ..."
};

// debugmodel (tied, head_dim 64 with dim 256 / 8 heads), tiny (untied: the layout-parity model,
// split by TP 2, CP 2 and 2 pipeline stages), and the published 0.6B, 1.7B, 4B (tied), 8B, 14B,
// 32B (untied). `vocab_size` overrides the flavor's. Unknown names are a loom::UsageError.
ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size = std::nullopt);
std::vector<std::string> flavor_names();

// Loom's JSON form of the args (the checkpoint's model entry); unknown keys are an error.
nlohmann::json to_json(const ModelArgs& args);
ModelArgs model_args_from_json(const nlohmann::json& json, const std::string& source);

// The initialization table below (Qwen3::parameter_init), for the families that share Qwen3's
// layers (Qwen3-MoE).
nn::ParameterInit parameter_init(const ModelArgs& args, const std::string& name);

class Qwen3 : public models::Decoder {
 public:
  explicit Qwen3(ModelArgs args, const torch::TensorOptions& options = torch::TensorOptions());
  // TorchTitan's Qwen3 initialization: norms (QK-norms included) ones; wq/wk/wv/w1
  // trunc_normal(0.02); wo/w2/w3 trunc_normal(0.02 / sqrt(2 (layer_id + 1))) (depth_init, else
  // 0.02 / sqrt(2 n_layers)); output trunc_normal(dim^-0.5, +-3 std); tok_embeddings normal(0, 1),
  // or the output's initialization when it is the tied head.
  nn::ParameterInit parameter_init(const std::string& name) const override;
  const ModelArgs& args() const { return args_; }

 private:
  const ModelArgs& args_;  // owned by the Decoder
};

}  // namespace loom::qwen3
