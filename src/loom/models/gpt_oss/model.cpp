#include "loom/models/gpt_oss/model.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <set>

#include "loom/core/error.h"
#include "loom/nn/rope.h"

namespace loom::gpt_oss {

ModelArgs::ModelArgs() {
  // gpt-oss-20b
  dim = 2880, n_layers = 24, n_heads = 64, n_kv_heads = 8, fixed_head_dim = 64, vocab_size = 201088;
  norm_eps = 1e-5, rope_theta = 150000.0, max_seq_len = 131072, tie_embeddings = false;
}

bool ModelArgs::is_sliding(int64_t layer_id) const {
  if (default_sliding_layers) return layer_id % 2 == 0;
  return std::find(sliding_layers_list.begin(), sliding_layers_list.end(), layer_id) != sliding_layers_list.end();
}

nn::AttentionOptions ModelArgs::attention_options(int64_t layer_id) const {
  nn::AttentionOptions o = models::DecoderArgs::attention_options(layer_id);
  o.sinks = true;
  o.bias = attention_bias;
  o.sliding_window = is_sliding(layer_id) ? sliding_window : 0;
  return o;
}

double ModelArgs::attention_factor() const {
  if (rope_attention_factor > 0) return rope_attention_factor;
  return nn::yarn_mscale(rope_factor);
}

torch::Tensor ModelArgs::rope_cache_values() const {
  if (rope_factor <= 1.0) return models::DecoderArgs::rope_cache_values();
  nn::YarnScaling yarn;
  yarn.factor = rope_factor;
  yarn.original_max_position = original_seq_len;
  yarn.beta_fast = beta_fast;
  yarn.beta_slow = beta_slow;
  yarn.truncate = rope_truncate;
  // transformers multiplies cos and sin by the attention factor (so q.k by its square).
  return nn::rope_cache(nn::yarn_inverse_frequencies(head_dim(), rope_theta, yarn), max_seq_len) * attention_factor();
}

moe::MoEOptions ModelArgs::moe_options() const {
  moe::MoEOptions o;
  o.router.n_experts = n_experts;
  o.router.top_k = top_k;
  o.router.score_function = moe::ScoreFunction::kSoftmaxAfterTopK;
  o.router.gate_bias = true;
  o.hidden_dim = moe_ffn_dim;
  o.experts.bias = true;
  o.experts.activation = moe::ExpertActivation::kClampedSwiGLU;
  o.experts.swiglu_alpha = swiglu_alpha;
  o.experts.swiglu_limit = swiglu_limit;
  o.load_balance_coeff = load_balance_coeff;
  return o;
}

void ModelArgs::validate() const {
  models::DecoderArgs::validate();
  LOOM_REQUIRE_USAGE(n_experts >= 1 && top_k >= 1 && top_k <= n_experts, "GPT-OSS: top_k = ", top_k,
                     " must be in [1, n_experts = ", n_experts, "]");
  LOOM_REQUIRE_USAGE(moe_ffn_dim > 0, "GPT-OSS: moe_ffn_dim must be > 0, got ", moe_ffn_dim);
  LOOM_REQUIRE_USAGE(sliding_window >= 1, "GPT-OSS: sliding_window must be >= 1, got ", sliding_window);
  for (int64_t layer : sliding_layers_list) {
    LOOM_REQUIRE_USAGE(layer >= 0 && layer < n_layers, "GPT-OSS: sliding layer ", layer, " is not a layer of ",
                       n_layers);
  }
  LOOM_REQUIRE_USAGE(swiglu_alpha > 0 && swiglu_limit > 0, "GPT-OSS: swiglu_alpha and swiglu_limit must be > 0");
  LOOM_REQUIRE_USAGE(rope_factor >= 1.0, "GPT-OSS: rope_factor must be >= 1, got ", rope_factor);
  LOOM_REQUIRE_USAGE(rope_factor == 1.0 || (original_seq_len > 0 && beta_fast > beta_slow && beta_slow > 0),
                     "GPT-OSS: YaRN needs original_seq_len > 0 and beta_fast > beta_slow > 0");
  LOOM_REQUIRE_USAGE(load_balance_coeff >= 0, "GPT-OSS: load_balance_coeff must be >= 0");
  moe_options().experts.validate();
}

std::string ModelArgs::summary() const {
  int64_t sliding = 0;
  for (int64_t i = 0; i < n_layers; ++i) sliding += is_sliding(i) ? 1 : 0;
  return c10::str("dim ", dim, ", ", n_layers, " layers (", sliding, " with a ", sliding_window, "-token window), ",
                  n_heads, " heads (", n_kv_heads, " KV, head_dim ", head_dim(), ", sinks), ", n_experts,
                  " experts (top ", top_k, ", ffn ", moe_ffn_dim, "), vocab ", vocab_size,
                  rope_factor > 1 ? c10::str(", YaRN x", rope_factor) : std::string());
}

std::vector<std::string> flavor_names() { return {"debugmodel", "tiny", "20B", "120B"}; }

ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size) {
  ModelArgs a;
  if (name == "debugmodel") {
    // TorchTitan's debugmodel's shape (dim 256, 4 layers, 8 experts, vocab 2048) with CPU-sized
    // heads and experts, and a window shorter than the debug runs' rows so it is exercised.
    a.dim = 256, a.n_layers = 4, a.n_heads = 8, a.n_kv_heads = 2, a.fixed_head_dim = 32;
    a.n_experts = 8, a.top_k = 2, a.moe_ffn_dim = 256, a.vocab_size = 2048, a.max_seq_len = 2048;
    a.sliding_window = 64;
  } else if (name == "tiny") {
    a.dim = 64, a.n_layers = 2, a.n_heads = 4, a.n_kv_heads = 2, a.fixed_head_dim = 16;
    a.n_experts = 4, a.top_k = 2, a.moe_ffn_dim = 32, a.vocab_size = 2048, a.max_seq_len = 2048;
    a.sliding_window = 8;
  } else if (name == "20B") {
    // the defaults
  } else if (name == "120B") {
    a.n_layers = 36, a.n_experts = 128;
  } else {
    models::fail_unknown_flavor("GPT-OSS", name, flavor_names());
  }
  if (vocab_size) a.vocab_size = *vocab_size;
  a.validate();
  return a;
}

nlohmann::json to_json(const ModelArgs& a) {
  return {{"dim", a.dim},
          {"n_layers", a.n_layers},
          {"n_heads", a.n_heads},
          {"n_kv_heads", a.n_kv_heads},
          {"head_dim", a.head_dim()},
          {"vocab_size", a.vocab_size},
          {"norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"max_seq_len", a.max_seq_len},
          {"tie_embeddings", a.tie_embeddings},
          {"n_experts", a.n_experts},
          {"top_k", a.top_k},
          {"moe_ffn_dim", a.moe_ffn_dim},
          {"sliding_layers", a.default_sliding_layers ? nlohmann::json(nullptr) : nlohmann::json(a.sliding_layers_list)},
          {"sliding_window", a.sliding_window},
          {"attention_bias", a.attention_bias},
          {"swiglu_alpha", a.swiglu_alpha},
          {"swiglu_limit", a.swiglu_limit},
          {"rope_factor", a.rope_factor},
          {"original_seq_len", a.original_seq_len},
          {"beta_fast", a.beta_fast},
          {"beta_slow", a.beta_slow},
          {"rope_truncate", a.rope_truncate},
          {"rope_attention_factor", a.rope_attention_factor},
          {"load_balance_coeff", a.load_balance_coeff},
          {"depth_init", a.depth_init}};
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
    get("vocab_size", a.vocab_size), get("norm_eps", a.norm_eps), get("rope_theta", a.rope_theta);
    get("max_seq_len", a.max_seq_len), get("tie_embeddings", a.tie_embeddings);
    get("n_experts", a.n_experts), get("top_k", a.top_k), get("moe_ffn_dim", a.moe_ffn_dim);
    if (j.contains("sliding_layers") && !j.at("sliding_layers").is_null()) {
      a.sliding_layers_list = j.at("sliding_layers").get<std::vector<int64_t>>();
      a.default_sliding_layers = false;
    }
    get("sliding_window", a.sliding_window), get("attention_bias", a.attention_bias);
    get("swiglu_alpha", a.swiglu_alpha), get("swiglu_limit", a.swiglu_limit);
    get("rope_factor", a.rope_factor), get("original_seq_len", a.original_seq_len);
    get("beta_fast", a.beta_fast), get("beta_slow", a.beta_slow), get("rope_truncate", a.rope_truncate);
    get("rope_attention_factor", a.rope_attention_factor), get("load_balance_coeff", a.load_balance_coeff);
    get("depth_init", a.depth_init);
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

models::ParameterCounts count_parameters(const ModelArgs& a) {
  const int64_t q = a.n_heads * a.head_dim(), kv = a.n_kv_heads * a.head_dim();
  const int64_t bias = a.attention_bias ? 1 : 0;
  const int64_t attention = a.dim * (q + 2 * kv) + q * a.dim + bias * (q + 2 * kv + a.dim) + a.n_heads;
  const int64_t expert = 3 * a.dim * a.moe_ffn_dim + 2 * a.moe_ffn_dim + a.dim;  // weights and biases
  const int64_t router = a.n_experts * a.dim + a.n_experts;
  const int64_t layer = attention + 2 * a.dim + router + a.n_experts * expert;
  models::ParameterCounts c;
  c.embedding = a.vocab_size * a.dim;
  c.total = c.embedding + a.n_layers * layer + a.dim + (a.tie_embeddings ? 0 : a.vocab_size * a.dim);
  c.non_embedding = c.total - c.embedding;
  c.active = c.total - a.n_layers * (a.n_experts - a.top_k) * expert;
  return c;
}

GptOss::GptOss(ModelArgs args, const torch::TensorOptions& options)
    : models::Decoder("GptOss", std::make_shared<const ModelArgs>(std::move(args)),
                      [](int64_t layer_id, const models::DecoderArgs& d, const torch::TensorOptions& o)
                          -> std::shared_ptr<models::DecoderBlock> {
                        const auto& a = static_cast<const ModelArgs&>(d);
                        return std::make_shared<models::MoETransformerBlock>(layer_id, a, a.moe_options(), o);
                      },
                      options),
      args_(static_cast<const ModelArgs&>(decoder_args())) {}

nn::ParameterInit GptOss::parameter_init(const std::string& name) const {
  constexpr double kStd = 0.02;
  const double out_std = 1.0 / std::sqrt(static_cast<double>(args_.dim));
  const auto head = nn::ParameterInit::truncated_normal(out_std, -3 * out_std, 3 * out_std);
  if (name == "tok_embeddings.weight") return args_.tie_embeddings ? head : nn::ParameterInit::normal(kStd);
  if (name == "output.weight") return head;
  if (name == "norm.weight") return nn::ParameterInit::ones();
  const auto layer = models::split_layer_name(name);
  LOOM_REQUIRE(layer.has_value(), "no GPT-OSS initializer for parameter '", name, "'");
  const std::string& rest = layer->second;
  const double depth = args_.depth_init ? static_cast<double>(layer->first + 1) : static_cast<double>(args_.n_layers);
  const double std = kStd / std::sqrt(2.0 * depth);
  if (rest == "attention_norm.weight" || rest == "ffn_norm.weight") return nn::ParameterInit::ones();
  static const std::set<std::string> weights = {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                                                "attention.wo.weight", "attention.sinks"};
  static const std::set<std::string> biases = {"attention.wq.bias", "attention.wk.bias", "attention.wv.bias",
                                               "attention.wo.bias"};
  if (weights.count(rest)) return nn::ParameterInit::truncated_normal(std, -2.0, 2.0);
  if (biases.count(rest)) return nn::ParameterInit::zeros();
  if (auto moe = models::gpt_oss_moe_init(rest, std)) return *moe;
  fail("no GPT-OSS initializer for parameter '", name, "'");
}

}  // namespace loom::gpt_oss
