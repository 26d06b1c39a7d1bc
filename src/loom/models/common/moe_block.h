// The pre-norm block with a Mixture-of-Experts feed-forward (Qwen3-MoE's sparse layers; DeepSeek-V3's
// with its own attention): x + attention(attention_norm(x)), then + moe(ffn_norm(.)). Names:
// attention_norm, attention.{wq,wk,wv,wo[,q_norm,k_norm]}, ffn_norm, moe.{router.gate.weight,
// experts.{w1,w2,w3}, shared_experts.*, expert_bias} (GPT-OSS's options add router.gate.bias and
// experts.{b1,b2,b3}: moe/moe.h).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>

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

// TorchTitan's GPT-OSS initialisation of a sparse layer's MoE, for a family's init table: `rest`
// is the name after "layers.<i>." ("moe.router.gate.weight", ...). The router gate's weight and
// every expert stack, biases included (experts.{w1,w2,w3,b1,b2,b3}), trunc_normal(std) cut at
// +-2 (absolute, torch's trunc_normal_ default); the gate's bias zeros. TorchTitan's std is
// 0.02 / sqrt(2 (layer_id + 1)). nullopt for any other name (the family's own table decides).
std::optional<nn::ParameterInit> gpt_oss_moe_init(const std::string& rest, double std);

}  // namespace loom::models
