#include "loom/models/qwen3/model.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <set>

#include "loom/core/error.h"

namespace loom::qwen3 {

ModelArgs::ModelArgs() {
  dim = 1024, n_layers = 28, n_heads = 16, n_kv_heads = 8, fixed_head_dim = 128;
  vocab_size = 151936, norm_eps = 1e-6, rope_theta = 1e6, max_seq_len = 40960;
  qk_norm = true;
  tie_embeddings = true;
}

std::string ModelArgs::summary() const {
  return c10::str("dim ", dim, ", ", n_layers, " layers, ", n_heads, " heads (", n_kv_heads, " kv) x ", head_dim(),
                  ", ffn ", ffn_dim, ", vocab ", vocab_size, ", rope_theta ", rope_theta,
                  tie_embeddings ? ", tied head" : "");
}

std::vector<std::string> flavor_names() { return {"debugmodel", "tiny", "0.6B", "1.7B", "4B", "8B", "14B", "32B"}; }

ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size) {
  ModelArgs a;  // 0.6B
  auto set = [&](int64_t dim, int64_t layers, int64_t heads, int64_t ffn, bool tied) {
    a.dim = dim, a.n_layers = layers, a.n_heads = heads, a.ffn_dim = ffn, a.tie_embeddings = tied;
  };
  if (name == "debugmodel") {
    set(256, 6, 8, 768, true);
    a.n_kv_heads = 4, a.fixed_head_dim = 64, a.vocab_size = 2048, a.max_seq_len = 2048;
  } else if (name == "tiny") {
    set(64, 4, 4, 192, false);
    a.n_kv_heads = 2, a.fixed_head_dim = 32, a.vocab_size = 2048, a.max_seq_len = 2048;
  } else if (name == "0.6B") {
    set(1024, 28, 16, 3072, true);
  } else if (name == "1.7B") {
    set(2048, 28, 16, 6144, true);
  } else if (name == "4B") {
    set(2560, 36, 32, 9728, true);
  } else if (name == "8B") {
    set(4096, 36, 32, 12288, false);
  } else if (name == "14B") {
    set(5120, 40, 40, 17408, false);
  } else if (name == "32B") {
    set(5120, 64, 64, 25600, false);
  } else {
    models::fail_unknown_flavor("Qwen3", name, flavor_names());
  }
  if (vocab_size) a.vocab_size = *vocab_size;
  a.validate();
  return a;
}

nlohmann::json to_json(const ModelArgs& a) {
  return {{"dim", a.dim},           {"n_layers", a.n_layers},       {"n_heads", a.n_heads},
          {"n_kv_heads", a.n_kv_heads}, {"head_dim", a.head_dim()}, {"vocab_size", a.vocab_size},
          {"ffn_dim", a.ffn_dim},   {"norm_eps", a.norm_eps},       {"rope_theta", a.rope_theta},
          {"max_seq_len", a.max_seq_len}, {"tie_embeddings", a.tie_embeddings}, {"depth_init", a.depth_init}};
}

ModelArgs model_args_from_json(const nlohmann::json& j, const std::string& source) {
  LOOM_REQUIRE_USAGE(j.is_object(), source, ": model args must be a JSON object");
  const nlohmann::json known = to_json(ModelArgs());
  for (const auto& [key, value] : j.items()) {
    LOOM_REQUIRE_USAGE(known.contains(key), source, ": unknown model arg '", key, "'");
  }
  ModelArgs a;
  try {
    auto get = [&](const char* key, auto& field) {
      if (j.contains(key)) field = j.at(key).get<std::decay_t<decltype(field)>>();
    };
    get("dim", a.dim), get("n_layers", a.n_layers), get("n_heads", a.n_heads), get("n_kv_heads", a.n_kv_heads);
    int64_t head_dim = a.head_dim();
    get("head_dim", head_dim);
    a.fixed_head_dim = head_dim;
    get("vocab_size", a.vocab_size), get("ffn_dim", a.ffn_dim), get("norm_eps", a.norm_eps);
    get("rope_theta", a.rope_theta), get("max_seq_len", a.max_seq_len);
    get("tie_embeddings", a.tie_embeddings), get("depth_init", a.depth_init);
  } catch (const nlohmann::json::exception& e) {
    fail_usage(source, ": bad model args (", e.what(), ")");
  }
  try {
    a.validate();
  } catch (const UsageError& e) {
    fail_usage(source, ": ", e.what());
  }
  return a;
}

Qwen3::Qwen3(ModelArgs args, const torch::TensorOptions& options)
    : models::Decoder("Qwen3", std::make_shared<const ModelArgs>(std::move(args)),
                      [](int64_t layer_id, const models::DecoderArgs& a, const torch::TensorOptions& o) {
                        return std::make_shared<models::TransformerBlock>(layer_id, a, o);
                      },
                      options),
      args_(static_cast<const ModelArgs&>(decoder_args())) {}

nn::ParameterInit Qwen3::parameter_init(const std::string& name) const { return qwen3::parameter_init(args_, name); }

nn::ParameterInit parameter_init(const ModelArgs& args_, const std::string& name) {
  constexpr double kStd = 0.02;
  const double out_std = 1.0 / std::sqrt(static_cast<double>(args_.dim));
  const auto head = nn::ParameterInit::truncated_normal(out_std, -3 * out_std, 3 * out_std);
  if (name == "tok_embeddings.weight") return args_.tie_embeddings ? head : nn::ParameterInit::normal(1.0);
  if (name == "output.weight") return head;
  if (name == "norm.weight") return nn::ParameterInit::ones();
  const auto layer = models::split_layer_name(name);
  LOOM_REQUIRE(layer.has_value(), "no Qwen3 initializer for parameter '", name, "'");
  static const std::set<std::string> ones = {"attention_norm.weight", "ffn_norm.weight", "attention.q_norm.weight",
                                             "attention.k_norm.weight"};
  static const std::set<std::string> input = {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                                              "feed_forward.w1.weight"};
  static const std::set<std::string> output = {"attention.wo.weight", "feed_forward.w2.weight",
                                               "feed_forward.w3.weight"};
  if (ones.count(layer->second)) return nn::ParameterInit::ones();
  if (input.count(layer->second)) return nn::ParameterInit::truncated_normal(kStd, -2.0, 2.0);
  const double depth = args_.depth_init ? static_cast<double>(layer->first + 1) : static_cast<double>(args_.n_layers);
  if (output.count(layer->second)) return nn::ParameterInit::truncated_normal(kStd / std::sqrt(2.0 * depth), -2.0, 2.0);
  fail("no Qwen3 initializer for parameter '", name, "'");
}

}  // namespace loom::qwen3
