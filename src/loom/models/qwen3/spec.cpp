#include "loom/models/qwen3/spec.h"

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/models/common/decoder_spec.h"
#include "loom/models/common/hf_names.h"

namespace loom::qwen3 {
namespace {

const ModelArgs& args_of(const models::ModelArgs& args) {
  const auto* qwen = dynamic_cast<const ModelArgs*>(&args);
  LOOM_REQUIRE(qwen != nullptr, "qwen3's spec was given another model's args");
  return *qwen;
}

template <typename T>
T get_or(const nlohmann::json& j, const char* key, T fallback) {
  return j.contains(key) && !j.at(key).is_null() ? j.at(key).get<T>() : fallback;
}

}  // namespace

const models::TPPlan& tp_plan() { return models::transformer_tp_plan(); }

models::HfFormat::Config hf_config_to_model_args(const nlohmann::json& c, const std::string& source) {
  LOOM_REQUIRE(c.is_object(), source, " is not a JSON object");
  auto args = std::make_unique<ModelArgs>();
  ModelArgs& a = *args;
  try {
    LOOM_REQUIRE(get_or<std::string>(c, "hidden_act", "silu") == "silu", source, ": hidden_act '",
                 get_or<std::string>(c, "hidden_act", ""), "' is not supported (Qwen3 uses silu)");
    LOOM_REQUIRE(!get_or<bool>(c, "attention_bias", false), source, ": attention_bias is not supported");
    LOOM_REQUIRE(!get_or<bool>(c, "use_sliding_window", false), source,
                 ": use_sliding_window is not supported (Loom's attention is full causal)");
    // transformers 4.56+ also lists each layer's attention; a sliding one is not full causal.
    if (c.contains("layer_types") && c.at("layer_types").is_array()) {
      const nlohmann::json& types = c.at("layer_types");
      for (size_t i = 0; i < types.size(); ++i) {
        const std::string type = types[i].is_string() ? types[i].get<std::string>() : types[i].dump();
        LOOM_REQUIRE(type == "full_attention", source, ": layer_types[", i, "] '", type,
                     "' is not supported; Loom's Qwen3 attention is \"full_attention\" on every layer");
      }
    }
    a.dim = c.at("hidden_size").get<int64_t>();
    a.n_layers = c.at("num_hidden_layers").get<int64_t>();
    a.n_heads = c.at("num_attention_heads").get<int64_t>();
    a.n_kv_heads = get_or<int64_t>(c, "num_key_value_heads", a.n_heads);
    a.fixed_head_dim = get_or<int64_t>(c, "head_dim", a.dim / a.n_heads);
    a.vocab_size = c.at("vocab_size").get<int64_t>();
    a.ffn_dim = c.at("intermediate_size").get<int64_t>();
    a.norm_eps = get_or<double>(c, "rms_norm_eps", 1e-6);
    a.max_seq_len = get_or<int64_t>(c, "max_position_embeddings", 40960);
    a.tie_embeddings = get_or<bool>(c, "tie_word_embeddings", false);
    // transformers v5 keeps theta in "rope_parameters"; v4 in "rope_theta" (+ "rope_scaling").
    nlohmann::json rope = nlohmann::json::object();
    if (c.contains("rope_parameters") && c.at("rope_parameters").is_object()) rope = c.at("rope_parameters");
    if (c.contains("rope_scaling") && c.at("rope_scaling").is_object()) rope = c.at("rope_scaling");
    a.rope_theta = get_or<double>(rope, "rope_theta", get_or<double>(c, "rope_theta", 1e6));
    const std::string rope_type = get_or<std::string>(rope, "rope_type", get_or<std::string>(rope, "type", "default"));
    LOOM_REQUIRE(rope_type == "default", source, ": rope type '", rope_type,
                 "' is not supported for Qwen3; Loom implements \"default\"");
  } catch (const nlohmann::json::exception& e) {
    fail(source, ": not a usable Qwen3 config (", e.what(), ")");
  }
  try {
    a.validate();
  } catch (const UsageError& e) {
    fail(source, ": ", e.what());
  }
  const bool tied = a.tie_embeddings;
  return {std::move(args), tied};
}

nlohmann::json model_args_to_hf_config(const ModelArgs& a, const std::string& torch_dtype) {
  return {{"architectures", {"Qwen3ForCausalLM"}}, {"model_type", "qwen3"},
          {"hidden_size", a.dim},                   {"intermediate_size", a.ffn_dim},
          {"num_hidden_layers", a.n_layers},        {"num_attention_heads", a.n_heads},
          {"num_key_value_heads", a.n_kv_heads},    {"head_dim", a.head_dim()},
          {"vocab_size", a.vocab_size},             {"rms_norm_eps", a.norm_eps},
          {"max_position_embeddings", a.max_seq_len}, {"hidden_act", "silu"},
          {"attention_bias", false},                {"attention_dropout", 0.0},
          {"tie_word_embeddings", a.tie_embeddings}, {"torch_dtype", torch_dtype},
          {"rope_theta", a.rope_theta},             {"rope_scaling", nullptr},
          {"use_sliding_window", false},            {"sliding_window", nullptr},
          {"max_window_layers", a.n_layers}};
}

models::ModelSpec model_spec() {
  models::DecoderFamily family;
  family.name = "qwen3";
  family.flavors = flavor_names();
  family.flavor = [](const std::string& name, int64_t vocab_size) {
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(
        flavor(name, vocab_size > 0 ? std::optional<int64_t>(vocab_size) : std::nullopt)));
  };
  family.build = [](const models::DecoderArgs& args, const torch::TensorOptions& options) {
    return std::static_pointer_cast<models::Decoder>(std::make_shared<Qwen3>(args_of(args), options));
  };
  family.tp_plan = tp_plan();
  family.args_to_json = [](const models::DecoderArgs& args) { return to_json(args_of(args)); };
  family.args_from_json = [](const nlohmann::json& json, const std::string& source) {
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(model_args_from_json(json, source)));
  };
  models::HfFormat hf;
  hf.model_types = {"qwen3"};
  hf.read_config = hf_config_to_model_args;
  hf.write_config = [](const models::ModelArgs& args, const std::string& torch_dtype) {
    return model_args_to_hf_config(args_of(args), torch_dtype);
  };
  hf.to_loom_name = [](const std::string& name) { return models::hf_to_loom_decoder_name(name, /*qk_norm=*/true); };
  hf.to_hf_name = [](const std::string& name) { return models::loom_to_hf_decoder_name(name, /*qk_norm=*/true); };
  family.hf = std::move(hf);
  return models::decoder_spec(std::move(family));
}

}  // namespace loom::qwen3
