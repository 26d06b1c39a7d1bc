#include "loom/models/qwen3_moe/model.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"

namespace loom::qwen3_moe {

ModelArgs::ModelArgs() {
  // 30B-A3B
  dim = 2048, n_layers = 48, n_heads = 32, n_kv_heads = 4, fixed_head_dim = 128;
  ffn_dim = 6144, vocab_size = 151936, max_seq_len = 40960, tie_embeddings = false;
}

bool ModelArgs::is_sparse(int64_t layer_id) const {
  return n_experts > 0 && std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer_id) == mlp_only_layers.end() &&
         (layer_id + 1) % decoder_sparse_step == 0;
}

moe::MoEOptions ModelArgs::moe_options() const {
  moe::MoEOptions o;
  o.router.n_experts = n_experts;
  o.router.top_k = top_k;
  o.router.score_function = moe::ScoreFunction::kSoftmax;
  o.router.normalize = norm_topk_prob;
  o.hidden_dim = moe_ffn_dim;
  o.load_balance_coeff = load_balance_coeff;
  return o;
}

int64_t ModelArgs::routed_experts() const {
  for (int64_t i = 0; i < n_layers; ++i) {
    if (is_sparse(i)) return n_experts;
  }
  return 0;
}

void ModelArgs::validate() const {
  qwen3::ModelArgs::validate();
  LOOM_REQUIRE_USAGE(n_experts >= 1 && top_k >= 1 && top_k <= n_experts, "Qwen3-MoE: top_k = ", top_k,
                     " must be in [1, n_experts = ", n_experts, "]");
  LOOM_REQUIRE_USAGE(moe_ffn_dim > 0, "Qwen3-MoE: moe_ffn_dim must be > 0, got ", moe_ffn_dim);
  LOOM_REQUIRE_USAGE(decoder_sparse_step >= 1, "Qwen3-MoE: decoder_sparse_step must be >= 1, got ", decoder_sparse_step);
  for (int64_t layer : mlp_only_layers) {
    LOOM_REQUIRE_USAGE(layer >= 0 && layer < n_layers, "Qwen3-MoE: mlp_only_layers holds ", layer,
                       ", not a layer of ", n_layers);
  }
  LOOM_REQUIRE_USAGE(load_balance_coeff >= 0, "Qwen3-MoE: load_balance_coeff must be >= 0");
}

std::string ModelArgs::summary() const {
  return c10::str(qwen3::ModelArgs::summary(), ", ", n_experts, " experts (top ", top_k, ", ffn ", moe_ffn_dim,
                  norm_topk_prob ? ", renormalised" : "", ")");
}

std::vector<std::string> flavor_names() { return {"debugmodel", "tiny", "30B-A3B", "235B-A22B"}; }

ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size) {
  ModelArgs a;
  if (name == "debugmodel") {
    a.dim = 256, a.n_layers = 6, a.n_heads = 8, a.n_kv_heads = 4, a.fixed_head_dim = 64, a.ffn_dim = 768;
    a.n_experts = 8, a.top_k = 2, a.moe_ffn_dim = 256, a.vocab_size = 2048, a.max_seq_len = 2048;
  } else if (name == "tiny") {
    a.dim = 64, a.n_layers = 4, a.n_heads = 4, a.n_kv_heads = 2, a.fixed_head_dim = 32, a.ffn_dim = 192;
    a.n_experts = 8, a.top_k = 2, a.moe_ffn_dim = 64, a.vocab_size = 2048, a.max_seq_len = 2048;
    a.mlp_only_layers = {0};
  } else if (name == "30B-A3B") {
    // the defaults
  } else if (name == "235B-A22B") {
    a.dim = 4096, a.n_layers = 94, a.n_heads = 64, a.n_kv_heads = 4, a.ffn_dim = 12288, a.moe_ffn_dim = 1536;
  } else {
    models::fail_unknown_flavor("Qwen3-MoE", name, flavor_names());
  }
  if (vocab_size) a.vocab_size = *vocab_size;
  a.validate();
  return a;
}

nlohmann::json to_json(const ModelArgs& a) {
  nlohmann::json j = qwen3::to_json(a);
  j["n_experts"] = a.n_experts, j["top_k"] = a.top_k, j["moe_ffn_dim"] = a.moe_ffn_dim;
  j["norm_topk_prob"] = a.norm_topk_prob, j["mlp_only_layers"] = a.mlp_only_layers;
  j["decoder_sparse_step"] = a.decoder_sparse_step, j["load_balance_coeff"] = a.load_balance_coeff;
  return j;
}

ModelArgs model_args_from_json(const nlohmann::json& j, const std::string& source) {
  LOOM_REQUIRE_USAGE(j.is_object(), source, ": model args must be a JSON object");
  static const char* kMoeKeys[] = {"n_experts", "top_k", "moe_ffn_dim", "norm_topk_prob", "mlp_only_layers",
                                   "decoder_sparse_step", "load_balance_coeff"};
  nlohmann::json dense = j;
  for (const char* key : kMoeKeys) dense.erase(key);
  ModelArgs a;
  static_cast<qwen3::ModelArgs&>(a) = qwen3::model_args_from_json(dense, source);
  try {
    auto get = [&](const char* key, auto& field) {
      if (j.contains(key)) field = j.at(key).get<std::decay_t<decltype(field)>>();
    };
    get("n_experts", a.n_experts), get("top_k", a.top_k), get("moe_ffn_dim", a.moe_ffn_dim);
    get("norm_topk_prob", a.norm_topk_prob), get("mlp_only_layers", a.mlp_only_layers);
    get("decoder_sparse_step", a.decoder_sparse_step), get("load_balance_coeff", a.load_balance_coeff);
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
  models::ParameterCounts c = models::count_transformer_parameters(a);  // every layer dense
  const int64_t dense_ffn = 3 * a.dim * a.ffn_dim;
  const int64_t expert = 3 * a.dim * a.moe_ffn_dim;
  int64_t sparse_layers = 0;
  for (int64_t i = 0; i < a.n_layers; ++i) sparse_layers += a.is_sparse(i) ? 1 : 0;
  const int64_t sparse_ffn = a.n_experts * expert + a.n_experts * a.dim;  // experts + router gate
  c.total += sparse_layers * (sparse_ffn - dense_ffn);
  c.non_embedding = c.total - c.embedding;
  c.active = c.total - sparse_layers * (a.n_experts - a.top_k) * expert;
  return c;
}

Qwen3Moe::Qwen3Moe(ModelArgs args, const torch::TensorOptions& options)
    : models::Decoder("Qwen3Moe", std::make_shared<const ModelArgs>(std::move(args)),
                      [](int64_t layer_id, const models::DecoderArgs& d, const torch::TensorOptions& o)
                          -> std::shared_ptr<models::DecoderBlock> {
                        const auto& a = static_cast<const ModelArgs&>(d);
                        if (!a.is_sparse(layer_id)) return std::make_shared<models::TransformerBlock>(layer_id, a, o);
                        return std::make_shared<models::MoETransformerBlock>(layer_id, a, a.moe_options(), o);
                      },
                      options),
      args_(static_cast<const ModelArgs&>(decoder_args())) {}

nn::ParameterInit Qwen3Moe::parameter_init(const std::string& name) const {
  const auto layer = models::split_layer_name(name);
  if (layer && layer->second.rfind("moe.", 0) == 0) {
    constexpr double kStd = 0.02;
    const double depth = args_.depth_init ? static_cast<double>(layer->first + 1) : static_cast<double>(args_.n_layers);
    const double out_std = kStd / std::sqrt(2.0 * depth);
    const std::string& rest = layer->second;
    if (rest == "moe.experts.w1") return nn::ParameterInit::truncated_normal(kStd, -2.0, 2.0);
    if (rest == "moe.experts.w2" || rest == "moe.experts.w3" || rest == "moe.router.gate.weight") {
      return nn::ParameterInit::truncated_normal(out_std, -2.0, 2.0);
    }
    fail("no Qwen3-MoE initializer for parameter '", name, "'");
  }
  // Everything else is a Qwen3 parameter: the same table.
  return qwen3::parameter_init(args_, name);
}

}  // namespace loom::qwen3_moe
