#include "loom/models/common/moe_block.h"

namespace loom::models {

MoETransformerBlock::MoETransformerBlock(int64_t layer_id, const DecoderArgs& args, const moe::MoEOptions& moe_options,
                                         const torch::TensorOptions& options)
    : DecoderBlock("MoETransformerBlock", layer_id) {
  const nn::AttentionOptions variant = args.attention_options(layer_id);
  attention_norm_ = register_module("attention_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  attention_ = register_module(
      "attention", std::make_shared<nn::Attention>(args.dim, args.n_heads, args.n_kv_heads, options, variant));
  ffn_norm_ = register_module("ffn_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  moe_ = register_module("moe", std::make_shared<moe::MoE>(args.dim, moe_options, options));
}

torch::Tensor MoETransformerBlock::forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                                           const nn::TokenLayout& layout) {
  // As TransformerBlock: the lambda owns its arguments so activation checkpointing may re-run it.
  return call_with_hooks(x, [this, rope_cache, layout](const torch::Tensor& in) {
    const torch::Tensor attended = attention_->forward(attention_norm_->forward(in), rope_cache, layout);
    auto [h, normed] = ffn_norm_->add_and_forward(in, attended);
    return h + moe_->forward(normed);
  });
}

std::optional<nn::ParameterInit> gpt_oss_moe_init(const std::string& rest, double std) {
  if (rest == "moe.router.gate.bias") return nn::ParameterInit::zeros();
  static const char* kTruncated[] = {"moe.router.gate.weight", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3",
                                     "moe.experts.b1",         "moe.experts.b2", "moe.experts.b3"};
  for (const char* name : kTruncated) {
    if (rest == name) return nn::ParameterInit::truncated_normal(std, -2.0, 2.0);
  }
  return std::nullopt;
}

}  // namespace loom::models
