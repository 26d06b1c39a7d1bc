#include "loom/models/llama3/model.h"

#include <cmath>

#include "loom/core/error.h"

namespace loom::llama3 {

Transformer::Transformer(ModelArgs args, const torch::TensorOptions& options)
    : models::Decoder("Transformer", std::make_shared<const ModelArgs>(std::move(args)),
                      [](int64_t layer_id, const models::DecoderArgs& a, const torch::TensorOptions& o) {
                        return std::make_shared<TransformerBlock>(layer_id, a, o);
                      },
                      options),
      args_(static_cast<const ModelArgs&>(decoder_args())) {}

nn::ParameterInit Transformer::parameter_init(const std::string& name) const {
  return llama3::parameter_init(args_, name);
}

nn::ParameterInit parameter_init(const ModelArgs& args, const std::string& name) {
  constexpr double kStd = 0.02;
  auto ends_with = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (name == "tok_embeddings.weight") return nn::ParameterInit::normal(1.0);
  if (name == "norm.weight" || ends_with(".attention_norm.weight") || ends_with(".ffn_norm.weight")) {
    return nn::ParameterInit::ones();
  }
  if (name == "output.weight") {
    const double std = 1.0 / std::sqrt(static_cast<double>(args.dim));
    return nn::ParameterInit::truncated_normal(std, -3 * std, 3 * std);
  }
  const auto layer = models::split_layer_name(name);
  LOOM_REQUIRE(layer.has_value(), "no Llama 3 initializer for parameter '", name, "'");
  const double depth_std = args.depth_init ? kStd / std::sqrt(2.0 * static_cast<double>(layer->first + 1))
                                           : kStd / std::sqrt(2.0 * static_cast<double>(args.n_layers));
  const std::string& local = layer->second;
  if (local == "attention.wq.weight" || local == "attention.wk.weight" || local == "attention.wv.weight" ||
      local == "feed_forward.w1.weight") {
    return nn::ParameterInit::truncated_normal(kStd, -2.0, 2.0);
  }
  if (local == "attention.wo.weight" || local == "feed_forward.w2.weight" || local == "feed_forward.w3.weight") {
    return nn::ParameterInit::truncated_normal(depth_std, -2.0, 2.0);
  }
  fail("no Llama 3 initializer for parameter '", name, "'");
}

ParameterCounts count_parameters(const ModelArgs& a) { return models::count_transformer_parameters(a); }

}  // namespace loom::llama3
