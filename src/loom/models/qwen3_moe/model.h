// Qwen3-MoE: Qwen3's attention (QK-norm, a stated head_dim, RoPE theta 1e6, eps 1e-6) with
// Mixture-of-Experts feed-forwards: a softmax router picks top_k of n_experts SwiGLU experts per
// token (weights renormalised when norm_topk_prob), no shared expert; the layers listed in
// mlp_only_layers, and those off the decoder_sparse_step grid, keep a dense SwiGLU. Names: the
// shared decoder's, with layers.{i}.moe.{router.gate.weight, experts.{w1,w2,w3}, expert_bias} in
// the sparse layers (models/common/moe_block.h).
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/models/common/moe_block.h"
#include "loom/models/qwen3/model.h"

namespace loom::qwen3_moe {

struct ModelArgs : qwen3::ModelArgs {
  ModelArgs();
  int64_t n_experts = 128;       // num_experts
  int64_t top_k = 8;             // num_experts_per_tok
  int64_t moe_ffn_dim = 768;     // moe_intermediate_size
  bool norm_topk_prob = true;
  std::vector<int64_t> mlp_only_layers;
  int64_t decoder_sparse_step = 1;
  // Auxiliary-loss-free balancing of training runs (moe::MoEOptions::load_balance_coeff); 0 = off.
  double load_balance_coeff = 1e-3;

  bool is_sparse(int64_t layer_id) const;
  int64_t routed_experts() const override;
  moe::MoEOptions moe_options() const;
  void validate() const override;
  std::string summary() const override;
};

// debugmodel (8 experts, top 2, trains on the bundled data), tiny (the layout-parity model), and
// the published 30B-A3B and 235B-A22B. `vocab_size` overrides the flavor's.
ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size = std::nullopt);
std::vector<std::string> flavor_names();

nlohmann::json to_json(const ModelArgs& args);
ModelArgs model_args_from_json(const nlohmann::json& json, const std::string& source);

// Parameter counts from the shapes: total, and active = what one token passes through (top_k of
// the experts of each sparse layer).
models::ParameterCounts count_parameters(const ModelArgs& args);

class Qwen3Moe : public models::Decoder {
 public:
  explicit Qwen3Moe(ModelArgs args, const torch::TensorOptions& options = torch::TensorOptions());
  // Qwen3's table for the attention, norms, head and dense layers; in sparse layers (TorchTitan's
  // MoE init) the router gate and experts.w2/w3 trunc_normal(0.02 / sqrt(2 (layer_id + 1))), w1
  // trunc_normal(0.02).
  nn::ParameterInit parameter_init(const std::string& name) const override;
  const ModelArgs& args() const { return args_; }

 private:
  const ModelArgs& args_;
};

}  // namespace loom::qwen3_moe
