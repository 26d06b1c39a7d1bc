#include "loom/models/llama3/hf_adapter.h"

#include <nlohmann/json.hpp>

#include <utility>

#include "loom/core/error.h"

namespace loom::llama3 {
namespace {
template <typename T>
T get_or(const nlohmann::json& j, const char* key, T fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  return j.at(key).get<T>();
}
}  // namespace

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
    // A scaling without its type would silently read as no scaling at all.
    LOOM_REQUIRE_USAGE(rope.contains("rope_type") || rope.contains("type") || !rope.contains("factor"), source,
                       ": the rope scaling sets \"factor\" but no \"rope_type\" (or \"type\"); add the type it was "
                       "trained with (Loom reads \"default\" and \"llama3\")");
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

models::HfFormat hf_format() {
  models::HfFormat hf;
  hf.model_types = {"llama"};
  hf.read_config = [](const nlohmann::json& config, const std::string& source) {
    HfLlamaConfig c = hf_config_to_model_args(config, source);
    return models::HfFormat::Config{std::make_unique<ModelArgs>(std::move(c.args)), c.tie_word_embeddings};
  };
  hf.write_config = [](const models::ModelArgs& args, const std::string& torch_dtype) {
    return model_args_to_hf_config(dynamic_cast<const ModelArgs&>(args), torch_dtype);
  };
  hf.to_loom_name = hf_to_loom_name;
  hf.to_hf_name = loom_to_hf_name;
  return hf;
}

}  // namespace loom::llama3
