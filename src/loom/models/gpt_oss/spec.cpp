#include "loom/models/gpt_oss/spec.h"

#include <nlohmann/json.hpp>

#include <regex>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/models/common/decoder_spec.h"
#include "loom/models/common/hf_names.h"
#include "loom/moe/experts.h"
#include "loom/nn/rope.h"

namespace loom::gpt_oss {
namespace {

const ModelArgs& args_of(const models::ModelArgs& args) {
  const auto* a = dynamic_cast<const ModelArgs*>(&args);
  LOOM_REQUIRE(a != nullptr, "gpt_oss's spec was given another model's args");
  return *a;
}

template <typename T>
T get_or(const nlohmann::json& j, const char* key, T fallback) {
  return j.contains(key) && !j.at(key).is_null() ? j.at(key).get<T>() : fallback;
}

// Per-layer names beyond the Llama-style decoder's (hf_names.h), after "model.layers.<i>." and
// "layers.<i>.": the attention biases and sinks, the router.
const std::pair<const char*, const char*> kLayerNames[] = {
    {"self_attn.q_proj.bias", "attention.wq.bias"}, {"self_attn.k_proj.bias", "attention.wk.bias"},
    {"self_attn.v_proj.bias", "attention.wv.bias"}, {"self_attn.o_proj.bias", "attention.wo.bias"},
    {"self_attn.sinks", "attention.sinks"},         {"mlp.router.weight", "moe.router.gate.weight"},
    {"mlp.router.bias", "moe.router.gate.bias"},    {"mlp.experts.down_proj_bias", "moe.experts.b2"},
};

std::optional<std::string> to_loom_name(const std::string& hf_name) {
  if (auto name = models::hf_to_loom_decoder_name(hf_name, /*qk_norm=*/false)) {
    // The dense feed-forward names are not GPT-OSS's: every layer is an MoE.
    if (name->find(".feed_forward.") == std::string::npos) return name;
    return std::nullopt;
  }
  const std::string prefix = "model.";
  if (hf_name.rfind(prefix, 0) != 0) return std::nullopt;
  const auto layer = models::split_layer_name(hf_name.substr(prefix.size()));
  if (!layer) return std::nullopt;
  for (const auto& [hf, loom] : kLayerNames) {
    if (layer->second == hf) return c10::str("layers.", layer->first, ".", loom);
  }
  return std::nullopt;
}

std::optional<std::string> to_hf_name(const std::string& loom_name) {
  if (auto name = models::loom_to_hf_decoder_name(loom_name, /*qk_norm=*/false)) return name;
  const auto layer = models::split_layer_name(loom_name);
  if (!layer) return std::nullopt;
  for (const auto& [hf, loom] : kLayerNames) {
    if (layer->second == loom) return c10::str("model.layers.", layer->first, ".", hf);
  }
  return std::nullopt;
}

using Tensors = std::vector<std::pair<std::string, torch::Tensor>>;
const std::regex kHfExperts(R"(model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj))");
const std::regex kLoomExperts(R"(layers\.(\d+)\.moe\.experts\.(w1|w2|w3|b1|b3))");

// transformers' fused experts -> Loom's stacks (moe/experts.h's mapping).
std::optional<Tensors> to_loom_tensors(const std::string& hf_name, const torch::Tensor& value) {
  std::smatch m;
  if (!std::regex_match(hf_name, m, kHfExperts)) return std::nullopt;
  const std::string layer = c10::str("layers.", m[1], ".moe.experts.");
  const std::string kind = m[2];
  if (kind == "down_proj") return Tensors{{layer + "w2", moe::down_proj_to_w2(value)}};
  LOOM_REQUIRE(value.dim() >= 1 && value.size(-1) % 2 == 0, "'", hf_name, "' has shape ", value.sizes(),
               ": its last dim must hold the interleaved gate and up columns");
  if (kind == "gate_up_proj") {
    auto [w1, w3] = moe::split_interleaved_gate_up(value);
    return Tensors{{layer + "w1", w1}, {layer + "w3", w3}};
  }
  auto [b1, b3] = moe::split_interleaved_gate_up_bias(value);
  return Tensors{{layer + "b1", b1}, {layer + "b3", b3}};
}

// Loom's stacks -> transformers' fused experts: gate_up_proj (and its bias) when w1 (b1) is met,
// from w1 and w3; nothing for w3 and b3 themselves.
std::optional<Tensors> to_hf_tensors(const std::string& loom_name, const torch::Tensor& value,
                                     const models::HfFormat::LoomTensorLookup& loom_tensor) {
  std::smatch m;
  if (std::regex_match(loom_name, m, kLoomExperts)) {
    const std::string hf = c10::str("model.layers.", m[1], ".mlp.experts.");
    const std::string loom = c10::str("layers.", m[1], ".moe.experts.");
    const std::string kind = m[2];
    if (kind == "w2") return Tensors{{hf + "down_proj", moe::w2_to_down_proj(value)}};
    if (kind == "w1") return Tensors{{hf + "gate_up_proj", moe::interleave_gate_up(value, loom_tensor(loom + "w3"))}};
    if (kind == "b1") {
      return Tensors{{hf + "gate_up_proj_bias", moe::interleave_gate_up_bias(value, loom_tensor(loom + "b3"))}};
    }
    return Tensors{};  // w3, b3: inside gate_up_proj
  }
  if (loom_name.size() > 16 && loom_name.compare(loom_name.size() - 16, 16, ".moe.expert_bias") == 0) {
    if (value.abs().max().item<double>() != 0) {
      log::warn("export: ", loom_name, " (the load-balancing selection bias) has no place in GptOssForCausalLM and ",
                "is dropped; transformers will route with the unbiased logits");
    }
    return Tensors{};
  }
  return std::nullopt;
}

}  // namespace

models::HfFormat::Config hf_config_to_model_args(const nlohmann::json& c, const std::string& source) {
  LOOM_REQUIRE(c.is_object(), source, " is not a JSON object");
  auto args = std::make_unique<ModelArgs>();
  ModelArgs& a = *args;
  try {
    const std::string act = get_or<std::string>(c, "hidden_act", "silu");
    LOOM_REQUIRE(act == "silu", source, ": hidden_act '", act, "' is not supported (GPT-OSS's experts use silu)");
    if (c.contains("quantization_config") && c.at("quantization_config").is_object()) {
      const std::string method = get_or<std::string>(c.at("quantization_config"), "quant_method", "");
      LOOM_REQUIRE(method == "mxfp4", source, ": quantization_config.quant_method '", method,
                   "' is not supported; Loom dequantises \"mxfp4\" experts on load");
    }
    a.dim = c.at("hidden_size").get<int64_t>();
    a.n_layers = c.at("num_hidden_layers").get<int64_t>();
    a.n_heads = c.at("num_attention_heads").get<int64_t>();
    a.n_kv_heads = get_or<int64_t>(c, "num_key_value_heads", a.n_heads);
    a.fixed_head_dim = get_or<int64_t>(c, "head_dim", a.dim / a.n_heads);
    a.vocab_size = c.at("vocab_size").get<int64_t>();
    a.moe_ffn_dim = c.at("intermediate_size").get<int64_t>();
    a.n_experts = get_or<int64_t>(c, "num_local_experts", get_or<int64_t>(c, "num_experts", 0));
    a.top_k = get_or<int64_t>(c, "num_experts_per_tok", get_or<int64_t>(c, "experts_per_token", 4));
    a.norm_eps = get_or<double>(c, "rms_norm_eps", 1e-5);
    a.max_seq_len = get_or<int64_t>(c, "max_position_embeddings", 131072);
    a.tie_embeddings = get_or<bool>(c, "tie_word_embeddings", false);
    a.attention_bias = get_or<bool>(c, "attention_bias", true);
    a.swiglu_alpha = get_or<double>(c, "swiglu_alpha", 1.702);
    a.swiglu_limit = get_or<double>(c, "swiglu_limit", 7.0);
    a.load_balance_coeff = 0.0;
    // layer_types: "sliding_attention" or "full_attention" per layer (default: even layers slide).
    if (c.contains("layer_types") && c.at("layer_types").is_array()) {
      const nlohmann::json& types = c.at("layer_types");
      LOOM_REQUIRE(static_cast<int64_t>(types.size()) == a.n_layers, source, ": layer_types lists ", types.size(),
                   " layers but num_hidden_layers is ", a.n_layers);
      a.default_sliding_layers = false;
      for (size_t i = 0; i < types.size(); ++i) {
        const std::string type = types[i].is_string() ? types[i].get<std::string>() : types[i].dump();
        LOOM_REQUIRE(type == "sliding_attention" || type == "full_attention", source, ": layer_types[", i, "] '",
                     type, "' is not supported; GPT-OSS layers are \"sliding_attention\" or \"full_attention\"");
        if (type == "sliding_attention") a.sliding_layers_list.push_back(static_cast<int64_t>(i));
      }
    }
    const bool any_sliding = a.default_sliding_layers ? a.n_layers > 0 : !a.sliding_layers_list.empty();
    if (c.contains("sliding_window") && !c.at("sliding_window").is_null()) {
      a.sliding_window = c.at("sliding_window").get<int64_t>();
    } else {
      LOOM_REQUIRE(!any_sliding, source, ": sliding_window is null but layer_types has sliding_attention layers");
    }
    // transformers 5 keeps RoPE settings in rope_parameters, 4 in rope_theta / rope_scaling.
    nlohmann::json rope = get_or<nlohmann::json>(c, "rope_parameters", nlohmann::json::object());
    const nlohmann::json scaling = get_or<nlohmann::json>(c, "rope_scaling", nlohmann::json::object());
    for (const auto& [key, value] : scaling.items()) {
      if (!rope.contains(key)) rope[key] = value;
    }
    a.rope_theta = get_or<double>(rope, "rope_theta", get_or<double>(c, "rope_theta", 150000.0));
    const std::string type = get_or<std::string>(rope, "rope_type", get_or<std::string>(rope, "type", "default"));
    LOOM_REQUIRE(type == "default" || type == "yarn", source, ": rope type '", type,
                 "' is not supported for GPT-OSS; Loom implements \"yarn\" and \"default\"");
    if (type == "yarn") {
      LOOM_REQUIRE(rope.contains("factor") && rope.contains("original_max_position_embeddings"), source,
                   ": rope type \"yarn\" needs factor and original_max_position_embeddings");
      a.rope_factor = rope.at("factor").get<double>();
      a.original_seq_len = rope.at("original_max_position_embeddings").get<int64_t>();
      a.beta_fast = get_or<double>(rope, "beta_fast", 32.0);
      a.beta_slow = get_or<double>(rope, "beta_slow", 1.0);
      a.rope_truncate = get_or<bool>(rope, "truncate", true);  // transformers' default
      a.rope_attention_factor = get_or<double>(rope, "attention_factor", 0.0);
      const double mscale = get_or<double>(rope, "mscale", 0.0), mscale_all_dim = get_or<double>(rope, "mscale_all_dim", 0.0);
      if (a.rope_attention_factor == 0.0 && mscale != 0.0 && mscale_all_dim != 0.0) {
        a.rope_attention_factor = nn::yarn_mscale(a.rope_factor, mscale) / nn::yarn_mscale(a.rope_factor, mscale_all_dim);
      }
    } else {
      a.rope_factor = 1.0;
    }
  } catch (const nlohmann::json::exception& e) {
    fail(source, ": not a usable GPT-OSS config (", e.what(), ")");
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
  nlohmann::json layer_types = nlohmann::json::array();
  for (int64_t i = 0; i < a.n_layers; ++i) layer_types.push_back(a.is_sliding(i) ? "sliding_attention" : "full_attention");
  nlohmann::json rope = {{"rope_theta", a.rope_theta}, {"rope_type", a.rope_factor > 1.0 ? "yarn" : "default"}};
  if (a.rope_factor > 1.0) {
    rope["factor"] = a.rope_factor;
    rope["original_max_position_embeddings"] = a.original_seq_len;
    rope["beta_fast"] = a.beta_fast;
    rope["beta_slow"] = a.beta_slow;
    rope["truncate"] = a.rope_truncate;
    if (a.rope_attention_factor > 0) rope["attention_factor"] = a.rope_attention_factor;
  }
  return {{"architectures", {"GptOssForCausalLM"}},
          {"model_type", "gpt_oss"},
          {"hidden_size", a.dim},
          {"intermediate_size", a.moe_ffn_dim},
          {"num_hidden_layers", a.n_layers},
          {"num_attention_heads", a.n_heads},
          {"num_key_value_heads", a.n_kv_heads},
          {"head_dim", a.head_dim()},
          {"vocab_size", a.vocab_size},
          {"rms_norm_eps", a.norm_eps},
          {"max_position_embeddings", a.max_seq_len},
          {"hidden_act", "silu"},
          {"attention_bias", a.attention_bias},
          {"attention_dropout", 0.0},
          {"tie_word_embeddings", a.tie_embeddings},
          {"torch_dtype", torch_dtype},
          {"num_local_experts", a.n_experts},
          {"num_experts_per_tok", a.top_k},
          {"sliding_window", a.sliding_window},
          {"layer_types", layer_types},
          {"swiglu_alpha", a.swiglu_alpha},
          {"swiglu_limit", a.swiglu_limit},
          {"rope_parameters", rope},
          {"output_router_logits", false},
          {"router_aux_loss_coef", 0.0}};
}

models::ModelSpec model_spec() {
  models::DecoderFamily family;
  family.name = "gpt_oss";
  family.flavors = flavor_names();
  family.flavor = [](const std::string& name, int64_t vocab_size) {
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(
        flavor(name, vocab_size > 0 ? std::optional<int64_t>(vocab_size) : std::nullopt)));
  };
  family.build = [](const models::DecoderArgs& args, const torch::TensorOptions& options) {
    return std::static_pointer_cast<models::Decoder>(std::make_shared<GptOss>(args_of(args), options));
  };
  // The shared attention plan (colwise q/k/v with their biases, rowwise wo whose bias is added
  // once after the reduction, the sinks headwise) and the MoE layers replicated over TP, each rank
  // routing its own (sequence-parallel) tokens, as Qwen3-MoE's.
  family.tp_plan = models::transformer_tp_plan();
  family.tp_plan.push_back({"layers.*.moe", models::TPStyle::kTokenwise});
  family.count_parameters = [](const models::DecoderArgs& args) { return count_parameters(args_of(args)); };
  family.args_to_json = [](const models::DecoderArgs& args) { return to_json(args_of(args)); };
  family.args_from_json = [](const nlohmann::json& json, const std::string& source) {
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(model_args_from_json(json, source)));
  };
  models::HfFormat hf;
  hf.model_types = {"gpt_oss"};
  hf.read_config = hf_config_to_model_args;
  hf.write_config = [](const models::ModelArgs& args, const std::string& torch_dtype) {
    return model_args_to_hf_config(args_of(args), torch_dtype);
  };
  hf.to_loom_name = to_loom_name;
  hf.to_hf_name = to_hf_name;
  hf.to_loom_tensors = to_loom_tensors;
  hf.to_hf_tensors = to_hf_tensors;
  family.hf = std::move(hf);
  return models::decoder_spec(std::move(family));
}

}  // namespace loom::gpt_oss
