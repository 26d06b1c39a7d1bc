// The shared MoE block with GPT-OSS's options (moe::MoEOptions: router gate bias, softmax after
// top-k, expert biases, clamped SwiGLU) in a decoder: the new parameters have global names
// (layers.<i>.moe.router.gate.bias, layers.<i>.moe.experts.{b1,b2,b3}) that a family's init table
// reaches, and models::gpt_oss_moe_init (TorchTitan's GPT-OSS MoE init) initialises them: the gate
// bias zeros, the expert stacks and biases trunc_normal(0.02 / sqrt(2 (layer + 1))).
#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/moe_block.h"
#include "loom/models/qwen3_moe/model.h"

namespace test_moe_block {

loom::moe::MoEOptions gpt_oss_options(const loom::qwen3_moe::ModelArgs& a) {
  loom::moe::MoEOptions o = a.moe_options();
  o.router.score_function = loom::moe::ScoreFunction::kSoftmaxAfterTopK;
  o.router.normalize = false;
  o.router.gate_bias = true;
  o.experts.bias = true;
  o.experts.activation = loom::moe::ExpertActivation::kClampedSwiGLU;
  o.load_balance_coeff = 0;
  return o;
}

// A test-only decoder: Qwen3-MoE's tiny shapes, every layer an MoE block with GPT-OSS's options,
// its init table Qwen3's for the attention/norms/embeddings and gpt_oss_moe_init for the MoE.
class GptOssMoeDecoder : public loom::models::Decoder {
 public:
  explicit GptOssMoeDecoder(loom::qwen3_moe::ModelArgs args, const torch::TensorOptions& options)
      : loom::models::Decoder(
            "GptOssMoeTest", std::make_shared<const loom::qwen3_moe::ModelArgs>(std::move(args)),
            [](int64_t layer_id, const loom::models::DecoderArgs& d, const torch::TensorOptions& o)
                -> std::shared_ptr<loom::models::DecoderBlock> {
              const auto& a = static_cast<const loom::qwen3_moe::ModelArgs&>(d);
              return std::make_shared<loom::models::MoETransformerBlock>(layer_id, a, gpt_oss_options(a), o);
            },
            options) {}

  loom::nn::ParameterInit parameter_init(const std::string& name) const override {
    const auto layer = loom::models::split_layer_name(name);
    if (layer && layer->second.rfind("moe.", 0) == 0) {
      const double std = 0.02 / std::sqrt(2.0 * static_cast<double>(layer->first + 1));
      const auto init = loom::models::gpt_oss_moe_init(layer->second, std);
      LOOM_REQUIRE(init.has_value(), "no GPT-OSS MoE initializer for ", name);
      return *init;
    }
    return loom::qwen3::parameter_init(static_cast<const loom::qwen3::ModelArgs&>(decoder_args()), name);
  }
};

TEST(GptOssMoeBlock, NewParametersHaveGlobalNamesAndTorchTitansInit) {
  loom::qwen3_moe::ModelArgs args = loom::qwen3_moe::flavor("tiny");
  args.mlp_only_layers.clear();
  GptOssMoeDecoder model(args, torch::TensorOptions());
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model.named_parameters()) shapes[p.name] = p.tensor().sizes().vec();
  EXPECT_EQ(shapes.at("layers.2.moe.router.gate.bias"), (std::vector<int64_t>{8}));
  EXPECT_EQ(shapes.at("layers.2.moe.experts.b1"), (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(shapes.at("layers.2.moe.experts.b2"), (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(shapes.at("layers.2.moe.experts.b3"), (std::vector<int64_t>{8, 64}));
  EXPECT_FALSE(loom::models::gpt_oss_moe_init("moe.shared_experts.w1.weight", 0.01).has_value());
  model.init_weights(7);  // every parameter's init from the table (a missing one throws)
  for (int64_t layer : {0, 3}) {
    const std::string prefix = "layers." + std::to_string(layer) + ".moe.";
    const double want_std = 0.02 / std::sqrt(2.0 * (layer + 1));
    std::map<std::string, torch::Tensor> params;
    for (const auto& p : model.named_parameters()) params[p.name] = p.tensor();
    EXPECT_EQ(params.at(prefix + "router.gate.bias").abs().max().item<double>(), 0.0);
    for (const char* name : {"experts.w1", "experts.w2", "experts.w3", "experts.b1", "experts.b2", "experts.b3",
                             "router.gate.weight"}) {
      const torch::Tensor t = params.at(prefix + name);
      const double std = t.std().item<double>();
      // Thousands of draws: the sample std within 10% of the table's (b1 has 512, the fewest).
      EXPECT_NEAR(std, want_std, 0.1 * want_std) << prefix << name;
      EXPECT_LE(t.abs().max().item<double>(), 2.0) << prefix << name;
    }
  }
  // The block runs: tokens through the decoder give finite logits.
  const torch::Tensor logits = model.forward(torch::randint(0, args.vocab_size, {2, 16}));
  EXPECT_TRUE(torch::isfinite(logits).all().item<bool>());
}

}  // namespace test_moe_block
