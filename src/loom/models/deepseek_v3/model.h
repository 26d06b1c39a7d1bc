// DeepSeek-V3 (and the DeepSeek-V2 shapes TorchTitan trains as its 16B and 236B configs):
// multi-head latent attention (nn/mla.h) in every block; the first `n_dense_layers` blocks keep a
// dense SwiGLU, the others an MoE layer (moe/) with sigmoid scores, a selection bias (HF's
// e_score_correction_bias, moved by auxiliary-loss-free balancing), group-limited top-k
// (n_expert_groups / n_limited_groups), renormalised weights times route_scale, and shared experts.
// RoPE on the rope part of each head, YaRN-scaled when rope_factor > 1 (with its mscale^2 on the
// softmax scale). No multi-token prediction.
//
// Names: tok_embeddings, layers.{i}.{attention_norm, attention.{wq | wq_a, q_norm, wq_b}, wkv_a,
// kv_norm, wkv_b, wo}, ffn_norm, feed_forward.{w1,w2,w3} (dense) or moe.{router.gate.weight,
// experts.{w1,w2,w3}, shared_experts.{w1,w2,w3}.weight, expert_bias}}, norm, output.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/models/common/decoder.h"
#include "loom/moe/moe.h"
#include "loom/nn/mla.h"

namespace loom::deepseek_v3 {

struct ModelArgs : models::DecoderArgs {
  ModelArgs();
  int64_t inter_dim = 18432;      // intermediate_size: the dense layers' SwiGLU
  int64_t moe_inter_dim = 2048;   // moe_intermediate_size: each routed and shared expert
  int64_t n_dense_layers = 3;     // first_k_dense_replace
  int64_t n_routed_experts = 256;
  int64_t n_shared_experts = 1;
  int64_t n_activated_experts = 8;  // num_experts_per_tok
  int64_t n_expert_groups = 8;      // n_group
  int64_t n_limited_groups = 4;     // topk_group
  bool score_sigmoid = true;        // sigmoid scores (V3); false: softmax (V2)
  bool norm_topk_prob = true;
  double route_scale = 2.5;         // routed_scaling_factor
  double load_balance_coeff = 1e-3;  // the selection bias's step (moe::MoEOptions)
  // Multi-head latent attention.
  int64_t q_lora_rank = 1536;  // 0: a plain wq
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 128;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim_ = 128;
  bool rope_interleave = true;
  // YaRN (off when rope_factor <= 1).
  double rope_factor = 40.0;
  int64_t original_seq_len = 4096;  // original_max_position_embeddings
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 1.0;

  bool is_sparse(int64_t layer_id) const { return layer_id >= n_dense_layers; }
  bool yarn() const { return rope_factor > 1.0; }
  // YaRN's factor on cos/sin and the softmax scale's factor (mscale_all_dim's mscale squared).
  double rope_attention_factor() const;
  double softmax_scale() const;
  moe::MoEOptions moe_options() const;
  nn::MLAOptions mla_options() const;

  int64_t ffn_hidden_dim() const override { return inter_dim; }
  int64_t routed_experts() const override;
  int64_t qk_head_dim() const override { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t v_head_dim() const override { return v_head_dim_; }
  int64_t attention_kv_heads() const override { return n_heads; }
  int64_t rope_dim() const override { return qk_rope_head_dim; }
  torch::Tensor rope_cache_values() const override;
  void validate() const override;
  std::string summary() const override;
};

// debugmodel (trains on the bundled data), tiny (the layout-parity model), 16B (DeepSeek-V2-Lite's
// shape), 236B (DeepSeek-V2's), 671B (DeepSeek-V3). `vocab_size` overrides the flavor's.
ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size = std::nullopt);
std::vector<std::string> flavor_names();

nlohmann::json to_json(const ModelArgs& args);
ModelArgs model_args_from_json(const nlohmann::json& json, const std::string& source);

// Total and active (dense layers, attention, shared experts and top_k routed experts) counts.
models::ParameterCounts count_parameters(const ModelArgs& args);

// The pre-norm block: x + attention(attention_norm(x)), then + ffn(ffn_norm(.)) where ffn is the
// dense SwiGLU or the MoE layer.
class DeepSeekV3Block : public models::DecoderBlock {
 public:
  DeepSeekV3Block(int64_t layer_id, const ModelArgs& args, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                        const nn::TokenLayout& layout = {}) override;
  nn::MultiHeadLatentAttention& attention() override { return *attention_; }
  bool is_sparse() const { return moe_ != nullptr; }
  moe::MoE& moe() { return *moe_; }
  void reset_buffers() override {
    if (moe_) moe_->reset_state();
  }

 private:
  std::shared_ptr<nn::RMSNorm> attention_norm_;
  std::shared_ptr<nn::MultiHeadLatentAttention> attention_;
  std::shared_ptr<nn::RMSNorm> ffn_norm_;
  std::shared_ptr<nn::FeedForward> feed_forward_;  // dense layers
  std::shared_ptr<moe::MoE> moe_;                  // sparse layers
};

class DeepSeekV3 : public models::Decoder {
 public:
  explicit DeepSeekV3(ModelArgs args, const torch::TensorOptions& options = torch::TensorOptions());
  // TorchTitan's deepseek_v3 init: every projection trunc_normal(0.02), the output projections
  // (attention.wo, feed_forward.w2/w3, experts w2/w3, shared experts w2/w3, the router gate)
  // trunc_normal(0.02 / sqrt(2 (layer_id + 1))); norms ones; embedding N(0, 1); output head
  // trunc_normal(dim^-0.5, +-3 dim^-0.5).
  nn::ParameterInit parameter_init(const std::string& name) const override;
  const ModelArgs& args() const { return args_; }

 private:
  const ModelArgs& args_;
};

}  // namespace loom::deepseek_v3
