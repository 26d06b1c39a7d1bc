#include "loom/models/deepseek_v3/spec.h"

#include <nlohmann/json.hpp>

#include <regex>

#include "loom/core/error.h"
#include "loom/models/common/decoder_spec.h"
#include "loom/models/common/hf_names.h"

namespace loom::deepseek_v3 {
namespace {

const ModelArgs& args_of(const models::ModelArgs& args) {
  const auto* a = dynamic_cast<const ModelArgs*>(&args);
  LOOM_REQUIRE(a != nullptr, "deepseek_v3's spec was given another model's args");
  return *a;
}

// Per-layer names: HF's (after "model.layers.<i>.") and Loom's (after "layers.<i>.").
const std::vector<std::pair<std::string, std::string>>& layer_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"input_layernorm.weight", "attention_norm.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"self_attn.q_proj.weight", "attention.wq.weight"},
      {"self_attn.q_a_proj.weight", "attention.wq_a.weight"},
      {"self_attn.q_a_layernorm.weight", "attention.q_norm.weight"},
      {"self_attn.q_b_proj.weight", "attention.wq_b.weight"},
      {"self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight"},
      {"self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight"},
      {"self_attn.kv_b_proj.weight", "attention.wkv_b.weight"},
      {"self_attn.o_proj.weight", "attention.wo.weight"},
      {"mlp.gate_proj.weight", "feed_forward.w1.weight"},
      {"mlp.up_proj.weight", "feed_forward.w3.weight"},
      {"mlp.down_proj.weight", "feed_forward.w2.weight"},
      {"mlp.gate.weight", "moe.router.gate.weight"},
      {"mlp.gate.e_score_correction_bias", "moe.expert_bias"},
      {"mlp.shared_experts.gate_proj.weight", "moe.shared_experts.w1.weight"},
      {"mlp.shared_experts.up_proj.weight", "moe.shared_experts.w3.weight"},
      {"mlp.shared_experts.down_proj.weight", "moe.shared_experts.w2.weight"},
  };
  return names;
}

const std::regex kHfLayer(R"(model\.layers\.(\d+)\.(.+))");
const std::regex kLoomLayer(R"(layers\.(\d+)\.(.+))");
std::optional<std::string> to_loom_name(const std::string& name) {
  if (name == "model.embed_tokens.weight") return "tok_embeddings.weight";
  if (name == "model.norm.weight") return "norm.weight";
  if (name == "lm_head.weight") return "output.weight";
  std::smatch m;
  if (!std::regex_match(name, m, kHfLayer)) return std::nullopt;
  for (const auto& [hf, loom] : layer_names()) {
    if (m[2] == hf) return c10::str("layers.", m[1], ".", loom);
  }
  return std::nullopt;
}

std::optional<std::string> to_hf_name(const std::string& name) {
  if (name == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (name == "norm.weight") return "model.norm.weight";
  if (name == "output.weight") return "lm_head.weight";
  std::smatch m;
  if (!std::regex_match(name, m, kLoomLayer)) return std::nullopt;
  for (const auto& [hf, loom] : layer_names()) {
    if (m[2] == loom) return c10::str("model.layers.", m[1], ".", hf);
  }
  return std::nullopt;
}

template <typename T>
T get_or(const nlohmann::json& j, const char* key, T fallback) {
  return j.contains(key) && !j.at(key).is_null() ? j.at(key).get<T>() : fallback;
}

}  // namespace

const models::TPPlan& tp_plan() {
  // TorchTitan's deepseek_v3 plan without expert TP: attention heads split over tp (the query and
  // key/value up projections colwise, the output rowwise); the low-rank A projections and their
  // norms run replicated on the gathered sequence, each rank's heads giving part of their
  // gradients (summed); the dense SwiGLU as Llama's; the MoE layers token-wise.
  static const models::TPPlan plan = [] {
    using models::TPStyle;
    models::TPPlan p = {
        {"tok_embeddings", TPStyle::kRowwiseEmbedding},
        {"layers.*.attention_norm", TPStyle::kSequenceParallel},
        {"layers.*.attention", TPStyle::kPrepareInput},
        {"layers.*.attention.wq", TPStyle::kColwise},
        {"layers.*.attention.wq_a", TPStyle::kReplicatePartialGrad},
        {"layers.*.attention.q_norm", TPStyle::kReplicatePartialGrad},
        {"layers.*.attention.wq_b", TPStyle::kColwise},
        {"layers.*.attention.wkv_a", TPStyle::kReplicatePartialGrad},
        {"layers.*.attention.kv_norm", TPStyle::kReplicatePartialGrad},
        {"layers.*.attention.wkv_b", TPStyle::kColwise},
        {"layers.*.attention.wo", TPStyle::kRowwise},
        {"layers.*.ffn_norm", TPStyle::kSequenceParallel},
        {"layers.*.feed_forward", TPStyle::kPrepareInput, {"w1", "w3"}},
        {"layers.*.feed_forward.w1", TPStyle::kColwise},
        {"layers.*.feed_forward.w3", TPStyle::kColwise},
        {"layers.*.feed_forward.w2", TPStyle::kRowwise},
        {"layers.*.moe", TPStyle::kTokenwise},
        {"norm", TPStyle::kSequenceParallel},
        {"output", TPStyle::kColwiseOutput},
    };
    return p;
  }();
  return plan;
}

models::HfFormat::Config hf_config_to_model_args(const nlohmann::json& c, const std::string& source) {
  LOOM_REQUIRE(c.is_object(), source, " is not a JSON object");
  auto args = std::make_unique<ModelArgs>();
  ModelArgs& a = *args;
  bool tied = false;
  try {
    LOOM_REQUIRE(get_or<std::string>(c, "hidden_act", "silu") == "silu", source, ": hidden_act '",
                 get_or<std::string>(c, "hidden_act", ""), "' is not supported (DeepSeek-V3 uses silu)");
    LOOM_REQUIRE(!get_or<bool>(c, "attention_bias", false), source, ": attention_bias is not supported");
    LOOM_REQUIRE(get_or<std::string>(c, "topk_method", "noaux_tc") == "noaux_tc", source, ": topk_method '",
                 get_or<std::string>(c, "topk_method", ""), "' is not supported (DeepSeek-V3's is noaux_tc)");
    a.dim = c.at("hidden_size").get<int64_t>();
    a.n_layers = c.at("num_hidden_layers").get<int64_t>();
    a.n_heads = c.at("num_attention_heads").get<int64_t>();
    a.n_kv_heads = a.n_heads;
    a.vocab_size = c.at("vocab_size").get<int64_t>();
    a.max_seq_len = get_or<int64_t>(c, "max_position_embeddings", 4096);
    a.norm_eps = get_or<double>(c, "rms_norm_eps", 1e-6);
    a.inter_dim = c.at("intermediate_size").get<int64_t>();
    a.moe_inter_dim = c.at("moe_intermediate_size").get<int64_t>();
    a.n_dense_layers = get_or<int64_t>(c, "first_k_dense_replace", 0);
    a.n_routed_experts = c.at("n_routed_experts").get<int64_t>();
    a.n_shared_experts = get_or<int64_t>(c, "n_shared_experts", 0);
    a.n_activated_experts = c.at("num_experts_per_tok").get<int64_t>();
    a.n_expert_groups = get_or<int64_t>(c, "n_group", 1);
    a.n_limited_groups = get_or<int64_t>(c, "topk_group", 1);
    a.norm_topk_prob = get_or<bool>(c, "norm_topk_prob", true);
    a.route_scale = get_or<double>(c, "routed_scaling_factor", 1.0);
    const std::string scoring = get_or<std::string>(c, "scoring_func", "sigmoid");
    LOOM_REQUIRE_USAGE(scoring == "sigmoid" || scoring == "softmax", source, ": scoring_func '", scoring,
                       "' is not supported; the router scores with \"sigmoid\" (DeepSeek-V3) or \"softmax\"");
    a.score_sigmoid = scoring == "sigmoid";
    a.q_lora_rank = get_or<int64_t>(c, "q_lora_rank", 0);
    a.kv_lora_rank = c.at("kv_lora_rank").get<int64_t>();
    a.qk_nope_head_dim = c.at("qk_nope_head_dim").get<int64_t>();
    a.qk_rope_head_dim = c.at("qk_rope_head_dim").get<int64_t>();
    a.v_head_dim_ = c.at("v_head_dim").get<int64_t>();
    a.rope_interleave = get_or<bool>(c, "rope_interleave", true);
    tied = get_or<bool>(c, "tie_word_embeddings", false);
    a.tie_embeddings = tied;
    // transformers 5 keeps RoPE settings in rope_parameters, 4 in rope_theta / rope_scaling.
    nlohmann::json rope = get_or<nlohmann::json>(c, "rope_parameters", nlohmann::json::object());
    const nlohmann::json scaling = get_or<nlohmann::json>(c, "rope_scaling", nlohmann::json::object());
    for (const auto& [key, value] : scaling.items()) {
      if (!rope.contains(key)) rope[key] = value;
    }
    a.rope_theta = get_or<double>(rope, "rope_theta", get_or<double>(c, "rope_theta", 10000.0));
    const std::string type = get_or<std::string>(rope, "rope_type", get_or<std::string>(rope, "type", "default"));
    LOOM_REQUIRE(type == "default" || type == "yarn", source, ": rope type '", type,
                 "' is not supported (DeepSeek-V3 uses default or yarn)");
    if (type == "yarn") {
      a.rope_factor = rope.at("factor").get<double>();
      a.original_seq_len = rope.at("original_max_position_embeddings").get<int64_t>();
      a.beta_fast = get_or<double>(rope, "beta_fast", 32.0);
      a.beta_slow = get_or<double>(rope, "beta_slow", 1.0);
      a.mscale = get_or<double>(rope, "mscale", 0.0);
      a.mscale_all_dim = get_or<double>(rope, "mscale_all_dim", 0.0);
      LOOM_REQUIRE(!rope.contains("attention_factor") || rope.at("attention_factor").is_null(), source,
                   ": rope_parameters.attention_factor is not supported (Loom derives it from mscale)");
    } else {
      a.rope_factor = 1.0;
    }
  } catch (const nlohmann::json::exception& e) {
    fail(source, ": not a usable DeepSeek-V3 config (", e.what(), ")");
  }
  a.fixed_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim;
  try {
    a.validate();
  } catch (const UsageError& e) {
    fail(source, ": ", e.what());
  }
  return {std::move(args), tied};
}

nlohmann::json model_args_to_hf_config(const ModelArgs& a, const std::string& torch_dtype) {
  nlohmann::json rope = {{"rope_theta", a.rope_theta}, {"rope_type", a.yarn() ? "yarn" : "default"}};
  if (a.yarn()) {
    rope["factor"] = a.rope_factor;
    rope["original_max_position_embeddings"] = a.original_seq_len;
    rope["beta_fast"] = a.beta_fast;
    rope["beta_slow"] = a.beta_slow;
    rope["mscale"] = a.mscale;
    rope["mscale_all_dim"] = a.mscale_all_dim;
  }
  nlohmann::json c = {
      {"architectures", {"DeepseekV3ForCausalLM"}},
      {"model_type", "deepseek_v3"},
      {"hidden_size", a.dim},
      {"num_hidden_layers", a.n_layers},
      {"num_attention_heads", a.n_heads},
      {"num_key_value_heads", a.n_heads},
      {"vocab_size", a.vocab_size},
      {"max_position_embeddings", a.max_seq_len},
      {"rms_norm_eps", a.norm_eps},
      {"intermediate_size", a.inter_dim},
      {"moe_intermediate_size", a.moe_inter_dim},
      {"first_k_dense_replace", a.n_dense_layers},
      {"n_routed_experts", a.n_routed_experts},
      {"n_shared_experts", a.n_shared_experts},
      {"num_experts_per_tok", a.n_activated_experts},
      {"n_group", a.n_expert_groups},
      {"topk_group", a.n_limited_groups},
      {"norm_topk_prob", a.norm_topk_prob},
      {"routed_scaling_factor", a.route_scale},
      {"scoring_func", a.score_sigmoid ? "sigmoid" : "softmax"},
      {"topk_method", "noaux_tc"},
      {"q_lora_rank", a.q_lora_rank > 0 ? nlohmann::json(a.q_lora_rank) : nlohmann::json(nullptr)},
      {"kv_lora_rank", a.kv_lora_rank},
      {"qk_nope_head_dim", a.qk_nope_head_dim},
      {"qk_rope_head_dim", a.qk_rope_head_dim},
      {"v_head_dim", a.v_head_dim_},
      {"rope_interleave", a.rope_interleave},
      {"rope_parameters", rope},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"tie_word_embeddings", a.tie_embeddings},
      {"torch_dtype", torch_dtype},
  };
  return c;
}

models::ModelSpec model_spec() {
  models::DecoderFamily family;
  family.name = "deepseek_v3";
  family.flavors = flavor_names();
  family.flavor = [](const std::string& name, int64_t vocab_size) {
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(
        flavor(name, vocab_size > 0 ? std::optional<int64_t>(vocab_size) : std::nullopt)));
  };
  family.build = [](const models::DecoderArgs& args, const torch::TensorOptions& options) {
    return std::static_pointer_cast<models::Decoder>(std::make_shared<DeepSeekV3>(args_of(args), options));
  };
  family.tp_plan = tp_plan();
  family.count_parameters = [](const models::DecoderArgs& args) { return count_parameters(args_of(args)); };
  family.args_to_json = [](const models::DecoderArgs& args) { return to_json(args_of(args)); };
  family.args_from_json = [](const nlohmann::json& json, const std::string& source) {
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(model_args_from_json(json, source)));
  };
  models::HfFormat hf;
  hf.model_types = {"deepseek_v3"};
  hf.read_config = hf_config_to_model_args;
  hf.write_config = [](const models::ModelArgs& args, const std::string& torch_dtype) {
    return model_args_to_hf_config(args_of(args), torch_dtype);
  };
  hf.to_loom_name = to_loom_name;
  hf.to_hf_name = to_hf_name;
  hf.to_loom_pieces = models::hf_expert_pieces;
  hf.to_hf_tensors = [](const std::string& name, const torch::Tensor& value, const models::HfFormat::LoomTensorLookup&) {
    return models::experts_to_hf_tensors(name, value);
  };
  family.hf = std::move(hf);
  return models::decoder_spec(std::move(family));
}

}  // namespace loom::deepseek_v3
