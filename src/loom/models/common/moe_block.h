// The pre-norm block with a Mixture-of-Experts feed-forward (Qwen3-MoE's sparse layers; DeepSeek-V3's
// with its own attention): x + attention(attention_norm(x)), then + moe(ffn_norm(.)). Names:
// attention_norm, attention.{wq,wk,wv,wo[,q_norm,k_norm]}, ffn_norm, moe.{router.gate.weight,
// experts.{w1,w2,w3}, shared_experts.*, expert_bias}.
#pragma once
#include <torch/torch.h>

#include <memory>

#include "loom/models/common/decoder.h"
#include "loom/moe/moe.h"

namespace loom::models {

class MoETransformerBlock : public DecoderBlock {
 public:
  MoETransformerBlock(int64_t layer_id, const DecoderArgs& args, const moe::MoEOptions& moe_options,
                      const torch::TensorOptions& options);

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                        const nn::TokenLayout& layout = {}) override;

  nn::RMSNorm& attention_norm() { return *attention_norm_; }
  nn::Attention& attention() override { return *attention_; }
  nn::RMSNorm& ffn_norm() { return *ffn_norm_; }
  moe::MoE& moe() { return *moe_; }
  void reset_buffers() override { moe_->reset_state(); }

 private:
  std::shared_ptr<nn::RMSNorm> attention_norm_;
  std::shared_ptr<nn::Attention> attention_;
  std::shared_ptr<nn::RMSNorm> ffn_norm_;
  std::shared_ptr<moe::MoE> moe_;
};

}  // namespace loom::models
