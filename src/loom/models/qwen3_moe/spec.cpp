#include "loom/models/qwen3_moe/spec.h"

#include <nlohmann/json.hpp>

#include <regex>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/models/common/decoder_spec.h"
#include "loom/models/common/hf_names.h"
#include "loom/models/qwen3/spec.h"

namespace loom::qwen3_moe {
namespace {

const ModelArgs& args_of(const models::ModelArgs& args) {
  const auto* a = dynamic_cast<const ModelArgs*>(&args);
  LOOM_REQUIRE(a != nullptr, "qwen3_moe's spec was given another model's args");
  return *a;
}

// HF's names of a sparse layer's MoE ("model.layers.<i>.mlp.<rest>") and Loom's ("layers.<i>.moe.<rest>").
const std::regex kHfGate(R"(model\.layers\.(\d+)\.mlp\.gate\.weight)");
const std::regex kLoomGate(R"(layers\.(\d+)\.moe\.router\.gate\.weight)");

std::vector<models::HfFormat::Piece> to_loom_pieces(const std::string& name, c10::IntArrayRef shape) {
  auto pieces = models::hf_expert_pieces(name, shape);
  if (!pieces.empty()) return pieces;
  std::smatch m;
  if (std::regex_match(name, m, kHfGate)) return {{c10::str("layers.", m[1], ".moe.router.gate.weight")}};
  return {};
}

std::optional<std::vector<std::pair<std::string, torch::Tensor>>> to_hf_tensors(const std::string& name,
                                                                                const torch::Tensor& value) {
  if (auto experts = models::experts_to_hf_tensors(name, value)) return experts;
  std::smatch m;
  if (std::regex_match(name, m, kLoomGate)) {
    return std::vector<std::pair<std::string, torch::Tensor>>{{c10::str("model.layers.", m[1], ".mlp.gate.weight"), value}};
  }
  if (name.size() > 16 && name.compare(name.size() - 16, 16, ".moe.expert_bias") == 0) {
    // Qwen3MoeForCausalLM has no selection bias: a trained one changes which experts transformers
    // would pick, so say so.
    if (value.abs().max().item<double>() != 0) {
      log::warn("export: ", name, " (the load-balancing selection bias) has no place in Qwen3MoeForCausalLM and is ",
                "dropped; transformers will route with the unbiased scores");
    }
    return std::vector<std::pair<std::string, torch::Tensor>>{};
  }
  return std::nullopt;
}

template <typename T>
T get_or(const nlohmann::json& j, const char* key, T fallback) {
  return j.contains(key) && !j.at(key).is_null() ? j.at(key).get<T>() : fallback;
}

}  // namespace

models::HfFormat::Config hf_config_to_model_args(const nlohmann::json& c, const std::string& source) {
  models::HfFormat::Config dense = qwen3::hf_config_to_model_args(c, source);
  auto args = std::make_unique<ModelArgs>();
  ModelArgs& a = *args;
  static_cast<qwen3::ModelArgs&>(a) = static_cast<const qwen3::ModelArgs&>(*dense.args);
  try {
    // transformers 5 writes num_local_experts, 4 num_experts.
    a.n_experts = get_or<int64_t>(c, "num_local_experts", get_or<int64_t>(c, "num_experts", 0));
    a.top_k = c.at("num_experts_per_tok").get<int64_t>();
    a.moe_ffn_dim = c.at("moe_intermediate_size").get<int64_t>();
    a.norm_topk_prob = get_or<bool>(c, "norm_topk_prob", false);
    a.mlp_only_layers = get_or<std::vector<int64_t>>(c, "mlp_only_layers", {});
    a.decoder_sparse_step = get_or<int64_t>(c, "decoder_sparse_step", 1);
    // Qwen3MoeForCausalLM routes without a selection bias: the model config.json describes has
    // none, so Loom's auxiliary-loss-free balancing (which trains one) is off, and a model trained
    // at this shape (model.flavor = "hf") exports back to transformers exactly.
    a.load_balance_coeff = 0;
    // Qwen2-MoE's shared expert (and DeepSeek's) is no part of Qwen3-MoE: its weights would have
    // nowhere to go, and the routed experts alone compute something else.
    for (const char* key : {"shared_expert_intermediate_size", "n_shared_experts"}) {
      const int64_t shared = get_or<int64_t>(c, key, 0);
      LOOM_REQUIRE(shared == 0, source, ": ", key, " ", shared,
                   " is not supported; Loom's qwen3_moe has routed experts only (0 shared experts)");
    }
  } catch (const nlohmann::json::exception& e) {
    fail(source, ": not a usable Qwen3-MoE config (", e.what(), ")");
  }
  try {
    a.validate();
  } catch (const UsageError& e) {
    fail(source, ": ", e.what());
  }
  return {std::move(args), dense.tie_word_embeddings};
}

nlohmann::json model_args_to_hf_config(const ModelArgs& a, const std::string& torch_dtype) {
  nlohmann::json c = qwen3::model_args_to_hf_config(a, torch_dtype);
  c["architectures"] = {"Qwen3MoeForCausalLM"};
  c["model_type"] = "qwen3_moe";
  c["num_experts"] = a.n_experts;
  c["num_local_experts"] = a.n_experts;
  c["num_experts_per_tok"] = a.top_k;
  c["moe_intermediate_size"] = a.moe_ffn_dim;
  c["norm_topk_prob"] = a.norm_topk_prob;
  c["mlp_only_layers"] = a.mlp_only_layers;
  c["decoder_sparse_step"] = a.decoder_sparse_step;
  c["output_router_logits"] = false;
  c["router_aux_loss_coef"] = 0.001;
  return c;
}

models::ModelSpec model_spec() {
  models::DecoderFamily family;
  family.name = "qwen3_moe";
  family.flavors = flavor_names();
  family.flavor = [](const std::string& name, int64_t vocab_size) {
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(
        flavor(name, vocab_size > 0 ? std::optional<int64_t>(vocab_size) : std::nullopt)));
  };
  family.build = [](const models::DecoderArgs& args, const torch::TensorOptions& options) {
    return std::static_pointer_cast<models::Decoder>(std::make_shared<Qwen3Moe>(args_of(args), options));
  };
  // Attention and the dense layers as Qwen3; the MoE layers replicated over TP, each rank routing
  // its own (sequence-parallel) tokens (no expert TP).
  family.tp_plan = qwen3::tp_plan();
  family.tp_plan.push_back({"layers.*.moe", models::TPStyle::kTokenwise});
  family.count_parameters = [](const models::DecoderArgs& args) { return count_parameters(args_of(args)); };
  family.args_to_json = [](const models::DecoderArgs& args) { return to_json(args_of(args)); };
  family.args_from_json = [](const nlohmann::json& json, const std::string& source) {
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(model_args_from_json(json, source)));
  };
  models::HfFormat hf;
  hf.model_types = {"qwen3_moe"};
  hf.read_config = hf_config_to_model_args;
  hf.write_config = [](const models::ModelArgs& args, const std::string& torch_dtype) {
    return model_args_to_hf_config(args_of(args), torch_dtype);
  };
  hf.to_loom_name = [](const std::string& name) { return models::hf_to_loom_decoder_name(name, /*qk_norm=*/true); };
  hf.to_hf_name = [](const std::string& name) { return models::loom_to_hf_decoder_name(name, /*qk_norm=*/true); };
  hf.to_loom_pieces = to_loom_pieces;
  hf.to_hf_tensors = [](const std::string& name, const torch::Tensor& value, const models::HfFormat::LoomTensorLookup&) {
    return to_hf_tensors(name, value);
  };
  family.hf = std::move(hf);
  return models::decoder_spec(std::move(family));
}

}  // namespace loom::qwen3_moe
