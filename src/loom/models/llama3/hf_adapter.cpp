#include "loom/models/llama3/hf_adapter.h"

#include <nlohmann/json.hpp>

#include <array>
#include <utility>

#include "loom/core/error.h"

namespace loom::llama3 {
namespace {
// Per-layer names: HF suffix after "model.layers.N.", Loom suffix after "layers.N.".
constexpr std::array<std::pair<const char*, const char*>, 9> kLayerNames = {{
    {"input_layernorm.weight", "attention_norm.weight"},
    {"self_attn.q_proj.weight", "attention.wq.weight"},
    {"self_attn.k_proj.weight", "attention.wk.weight"},
    {"self_attn.v_proj.weight", "attention.wv.weight"},
    {"self_attn.o_proj.weight", "attention.wo.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"mlp.gate_proj.weight", "feed_forward.w1.weight"},
    {"mlp.down_proj.weight", "feed_forward.w2.weight"},
    {"mlp.up_proj.weight", "feed_forward.w3.weight"},
}};
constexpr std::array<std::pair<const char*, const char*>, 3> kGlobalNames = {{
    {"model.embed_tokens.weight", "tok_embeddings.weight"},
    {"model.norm.weight", "norm.weight"},
    {"lm_head.weight", "output.weight"},
}};

// Splits "<prefix><digits>.<rest>" into (digits, rest); nullopt when `name` has another shape.
std::optional<std::pair<std::string, std::string>> split_layer(const std::string& name,
                                                               const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size()) return std::nullopt;
  std::string id = name.substr(prefix.size(), dot - prefix.size());
  if (id.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::make_pair(std::move(id), name.substr(dot + 1));
}

template <typename T>
T get_or(const nlohmann::json& j, const char* key, T fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  return j.at(key).get<T>();
}
}  // namespace

std::optional<std::string> hf_to_loom_name(const std::string& hf_name) {
  for (const auto& [hf, loom] : kGlobalNames) {
    if (hf_name == hf) return std::string(loom);
  }
  if (auto parts = split_layer(hf_name, "model.layers.")) {
    for (const auto& [hf, loom] : kLayerNames) {
      if (parts->second == hf) return "layers." + parts->first + "." + loom;
    }
  }
  return std::nullopt;
}

std::optional<std::string> loom_to_hf_name(const std::string& loom_name) {
  for (const auto& [hf, loom] : kGlobalNames) {
    if (loom_name == loom) return std::string(hf);
  }
  if (auto parts = split_layer(loom_name, "layers.")) {
    for (const auto& [hf, loom] : kLayerNames) {
      if (parts->second == loom) return "model.layers." + parts->first + "." + hf;
    }
  }
  return std::nullopt;
}

bool is_ignorable_hf_tensor(const std::string& hf_name) {
  const std::string suffix = "rotary_emb.inv_freq";
  return hf_name.size() >= suffix.size() &&
         hf_name.compare(hf_name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

HfLlamaConfig hf_config_to_model_args(const nlohmann::json& c, const std::string& source) {
  LOOM_REQUIRE(c.is_object(), source, " is not a JSON object");
  HfLlamaConfig out;
  ModelArgs& a = out.args;
  try {
    const std::string model_type = get_or<std::string>(c, "model_type", "llama");
    LOOM_REQUIRE(model_type == "llama", source, ": model_type '", model_type,
                 "' is not supported; Loom loads Llama checkpoints (model_type \"llama\")");
    const std::string act = get_or<std::string>(c, "hidden_act", "silu");
    LOOM_REQUIRE(act == "silu", source, ": hidden_act '", act, "' is not supported (need silu)");
    LOOM_REQUIRE(!get_or<bool>(c, "attention_bias", false) && !get_or<bool>(c, "mlp_bias", false),
                 source, ": attention_bias / mlp_bias are not supported (Llama 3 has no biases)");
    a.dim = c.at("hidden_size").get<int64_t>();
    a.n_layers = c.at("num_hidden_layers").get<int64_t>();
    a.n_heads = c.at("num_attention_heads").get<int64_t>();
    a.n_kv_heads = get_or<int64_t>(c, "num_key_value_heads", a.n_heads);
    a.vocab_size = c.at("vocab_size").get<int64_t>();
    a.ffn_dim = c.at("intermediate_size").get<int64_t>();
    a.ffn_dim_multiplier.reset();
    a.norm_eps = get_or<double>(c, "rms_norm_eps", 1e-6);
    a.max_seq_len = get_or<int64_t>(c, "max_position_embeddings", 2048);
    LOOM_REQUIRE(a.n_heads > 0 && a.dim % a.n_heads == 0, source, ": hidden_size ", a.dim,
                 " is not divisible by num_attention_heads ", a.n_heads);
    const int64_t head_dim = get_or<int64_t>(c, "head_dim", a.dim / a.n_heads);
    LOOM_REQUIRE(head_dim == a.dim / a.n_heads, source, ": head_dim ", head_dim,
                 " differs from hidden_size / num_attention_heads = ", a.dim / a.n_heads,
                 ", which Loom's attention does not support");
    const double partial = get_or<double>(c, "partial_rotary_factor", 1.0);
    LOOM_REQUIRE(partial == 1.0, source, ": partial_rotary_factor ", partial,
                 " is not supported (need 1.0)");
    out.tie_word_embeddings = get_or<bool>(c, "tie_word_embeddings", false);

    // transformers v5 keeps theta and scaling in "rope_parameters"; v4 in "rope_theta" and
    // "rope_scaling" (whose type key was "type" before "rope_type").
    nlohmann::json rope = nlohmann::json::object();
    if (c.contains("rope_parameters") && c.at("rope_parameters").is_object()) {
      rope = c.at("rope_parameters");
    } else if (c.contains("rope_scaling") && c.at("rope_scaling").is_object()) {
      rope = c.at("rope_scaling");
    }
    a.rope_theta = get_or<double>(rope, "rope_theta", get_or<double>(c, "rope_theta", 10000.0));
    const std::string rope_type =
        get_or<std::string>(rope, "rope_type", get_or<std::string>(rope, "type", "default"));
    if (rope_type == "default") {
      a.use_scaled_rope = false;
    } else if (rope_type == "llama3") {
      a.use_scaled_rope = true;
      a.rope_scaling.factor = rope.at("factor").get<double>();
      a.rope_scaling.low_freq_factor = rope.at("low_freq_factor").get<double>();
      a.rope_scaling.high_freq_factor = rope.at("high_freq_factor").get<double>();
      a.rope_scaling.original_max_position =
          get_or<int64_t>(rope, "original_max_position_embeddings", a.max_seq_len);
    } else {
      fail(source, ": rope type '", rope_type,
           "' is not supported; Loom implements \"default\" and \"llama3\"");
    }
  } catch (const nlohmann::json::exception& e) {
    fail(source, ": not a usable Llama config (", e.what(), ")");
  }
  try {
    a.validate();
  } catch (const UsageError& e) {
    fail(source, ": ", e.what());
  }
  return out;
}

nlohmann::json model_args_to_hf_config(const ModelArgs& a, const std::string& torch_dtype) {
  nlohmann::json c = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", a.dim},
      {"intermediate_size", a.ffn_hidden_dim()},
      {"num_hidden_layers", a.n_layers},
      {"num_attention_heads", a.n_heads},
      {"num_key_value_heads", a.n_kv_heads},
      {"head_dim", a.head_dim()},
      {"vocab_size", a.vocab_size},
      {"rms_norm_eps", a.norm_eps},
      {"max_position_embeddings", a.max_seq_len},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"mlp_bias", false},
      {"tie_word_embeddings", false},
      {"torch_dtype", torch_dtype},
      {"rope_theta", a.rope_theta},
      {"rope_scaling", nullptr},
  };
  if (a.use_scaled_rope) {
    c["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", a.rope_scaling.factor},
        {"low_freq_factor", a.rope_scaling.low_freq_factor},
        {"high_freq_factor", a.rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", a.rope_scaling.original_max_position},
    };
  }
  return c;
}

}  // namespace loom::llama3
