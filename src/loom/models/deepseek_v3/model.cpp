#include "loom/models/deepseek_v3/model.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <numbers>
#include <set>

#include "loom/core/error.h"
#include "loom/nn/rope.h"

namespace loom::deepseek_v3 {
using nn::yarn_mscale;

ModelArgs::ModelArgs() {
  // 671B
  dim = 7168, n_layers = 61, n_heads = 128, n_kv_heads = 128, vocab_size = 129280;
  norm_eps = 1e-6, rope_theta = 10000.0, max_seq_len = 4096 * 40, tie_embeddings = false;
  fixed_head_dim = qk_nope_head_dim + qk_rope_head_dim;
}

double ModelArgs::rope_attention_factor() const {
  if (!yarn()) return 1.0;
  if (mscale != 0 && mscale_all_dim != 0) return yarn_mscale(rope_factor, mscale) / yarn_mscale(rope_factor, mscale_all_dim);
  return yarn_mscale(rope_factor, 1.0);
}

double ModelArgs::softmax_scale() const {
  if (!yarn() || mscale_all_dim == 0) return 1.0;
  const double m = yarn_mscale(rope_factor, mscale_all_dim);
  return m * m;
}

torch::Tensor ModelArgs::rope_cache_values() const {
  const int64_t d = qk_rope_head_dim;
  if (!yarn()) return nn::rope_cache(nn::rope_inverse_frequencies(d, rope_theta, std::nullopt), max_seq_len);
  // YaRN (transformers' _compute_yarn_parameters; DeepSeek's range is truncated).
  nn::YarnScaling yarn;
  yarn.factor = rope_factor;
  yarn.original_max_position = original_seq_len;
  yarn.beta_fast = beta_fast;
  yarn.beta_slow = beta_slow;
  const torch::Tensor inv_freq = nn::yarn_inverse_frequencies(d, rope_theta, yarn);
  return nn::rope_cache(inv_freq, max_seq_len) * rope_attention_factor();
}

moe::MoEOptions ModelArgs::moe_options() const {
  moe::MoEOptions o;
  o.router.n_experts = n_routed_experts;
  o.router.top_k = n_activated_experts;
  o.router.score_function = score_sigmoid ? moe::ScoreFunction::kSigmoid : moe::ScoreFunction::kSoftmax;
  o.router.normalize = norm_topk_prob;
  o.router.scale = route_scale;
  o.router.n_groups = n_expert_groups;
  o.router.topk_groups = n_limited_groups;
  o.hidden_dim = moe_inter_dim;
  o.shared_hidden_dim = moe_inter_dim * n_shared_experts;
  o.load_balance_coeff = load_balance_coeff;
  return o;
}

nn::MLAOptions ModelArgs::mla_options() const {
  nn::MLAOptions o;
  o.n_heads = n_heads;
  o.q_lora_rank = q_lora_rank;
  o.kv_lora_rank = kv_lora_rank;
  o.qk_nope_head_dim = qk_nope_head_dim;
  o.qk_rope_head_dim = qk_rope_head_dim;
  o.v_head_dim = v_head_dim_;
  o.norm_eps = norm_eps;
  o.rope_interleave = rope_interleave;
  o.softmax_scale = softmax_scale();
  return o;
}

int64_t ModelArgs::routed_experts() const { return n_dense_layers < n_layers ? n_routed_experts : 0; }

void ModelArgs::validate() const {
  LOOM_REQUIRE_USAGE(n_kv_heads == n_heads, "DeepSeek-V3: n_kv_heads (", n_kv_heads,
                     ") must equal n_heads (", n_heads, "): every head has its own keys from the latent");
  LOOM_REQUIRE_USAGE(fixed_head_dim == qk_nope_head_dim + qk_rope_head_dim,
                     "DeepSeek-V3: the head width must be qk_nope_head_dim + qk_rope_head_dim");
  models::DecoderArgs::validate();
  LOOM_REQUIRE_USAGE(kv_lora_rank > 0 && qk_nope_head_dim > 0 && v_head_dim_ > 0 && q_lora_rank >= 0,
                     "DeepSeek-V3: kv_lora_rank, qk_nope_head_dim and v_head_dim must be > 0 and q_lora_rank >= 0");
  LOOM_REQUIRE_USAGE(qk_rope_head_dim > 0 && qk_rope_head_dim % 2 == 0,
                     "DeepSeek-V3: qk_rope_head_dim must be even and > 0, got ", qk_rope_head_dim);
  LOOM_REQUIRE_USAGE(inter_dim > 0 && moe_inter_dim > 0, "DeepSeek-V3: inter_dim and moe_inter_dim must be > 0");
  LOOM_REQUIRE_USAGE(n_dense_layers >= 0 && n_dense_layers <= n_layers, "DeepSeek-V3: n_dense_layers = ",
                     n_dense_layers, " must be in [0, n_layers = ", n_layers, "]");
  LOOM_REQUIRE_USAGE(n_shared_experts >= 0, "DeepSeek-V3: n_shared_experts must be >= 0");
  LOOM_REQUIRE_USAGE(load_balance_coeff > 0, "DeepSeek-V3: load_balance_coeff must be > 0 (the selection bias "
                     "e_score_correction_bias is part of the model), got ", load_balance_coeff);
  LOOM_REQUIRE_USAGE(!yarn() || (original_seq_len > 0 && beta_fast > beta_slow && beta_slow > 0),
                     "DeepSeek-V3: YaRN needs original_seq_len > 0 and beta_fast > beta_slow > 0");
  moe_options().router.validate();
}

std::string ModelArgs::summary() const {
  return c10::str("dim ", dim, ", ", n_layers, " layers (", n_dense_layers, " dense), ", n_heads, " MLA heads (q_lora ",
                  q_lora_rank, ", kv_lora ", kv_lora_rank, ", qk ", qk_nope_head_dim, "+", qk_rope_head_dim, ", v ",
                  v_head_dim_, "), ", n_routed_experts, " experts (top ", n_activated_experts, ", ", n_shared_experts,
                  " shared, ffn ", moe_inter_dim, ", groups ", n_expert_groups, "/", n_limited_groups, "), dense ffn ",
                  inter_dim, ", vocab ", vocab_size, yarn() ? c10::str(", YaRN x", rope_factor) : std::string());
}

std::vector<std::string> flavor_names() { return {"debugmodel", "tiny", "16B", "236B", "671B"}; }

ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size) {
  ModelArgs a;
  auto no_yarn = [&] { a.rope_factor = 1.0; };
  if (name == "debugmodel") {
    a.dim = 256, a.n_layers = 6, a.n_heads = 16, a.vocab_size = 2048, a.max_seq_len = 2048;
    a.inter_dim = 1024, a.moe_inter_dim = 256, a.n_dense_layers = 1, a.n_routed_experts = 8, a.n_shared_experts = 2;
    a.n_activated_experts = 3, a.n_expert_groups = 1, a.n_limited_groups = 1, a.route_scale = 1.0;
    a.q_lora_rank = 0, a.kv_lora_rank = 64, a.qk_nope_head_dim = 32, a.qk_rope_head_dim = 16, a.v_head_dim_ = 32;
    no_yarn();
  } else if (name == "tiny") {
    // Every code path at parity-test cost: the low-rank query path, groups, a shared expert.
    a.dim = 64, a.n_layers = 4, a.n_heads = 4, a.vocab_size = 2048, a.max_seq_len = 2048;
    a.inter_dim = 192, a.moe_inter_dim = 32, a.n_dense_layers = 1, a.n_routed_experts = 8, a.n_shared_experts = 1;
    a.n_activated_experts = 2, a.n_expert_groups = 2, a.n_limited_groups = 1, a.route_scale = 1.5;
    a.q_lora_rank = 32, a.kv_lora_rank = 32, a.qk_nope_head_dim = 16, a.qk_rope_head_dim = 8, a.v_head_dim_ = 16;
    no_yarn();
  } else if (name == "16B") {
    a.dim = 2048, a.n_layers = 27, a.n_heads = 16, a.vocab_size = 102400, a.max_seq_len = 4096;
    a.inter_dim = 10944, a.moe_inter_dim = 1408, a.n_dense_layers = 1, a.n_routed_experts = 64, a.n_shared_experts = 2;
    a.n_activated_experts = 6, a.n_expert_groups = 1, a.n_limited_groups = 1, a.route_scale = 1.0;
    a.q_lora_rank = 0;
    no_yarn();
  } else if (name == "236B") {
    a.dim = 5120, a.n_layers = 60, a.n_heads = 128, a.vocab_size = 102400, a.max_seq_len = 4096;
    a.inter_dim = 12288, a.moe_inter_dim = 1536, a.n_dense_layers = 1, a.n_routed_experts = 160, a.n_shared_experts = 2;
    a.n_activated_experts = 6, a.n_expert_groups = 8, a.n_limited_groups = 3, a.route_scale = 16.0;
    no_yarn();
  } else if (name == "671B") {
    // the defaults
  } else {
    models::fail_unknown_flavor("DeepSeek-V3", name, flavor_names());
  }
  a.n_kv_heads = a.n_heads;
  a.fixed_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim;
  if (vocab_size) a.vocab_size = *vocab_size;
  a.validate();
  return a;
}

nlohmann::json to_json(const ModelArgs& a) {
  return {{"dim", a.dim},
          {"n_layers", a.n_layers},
          {"n_heads", a.n_heads},
          {"vocab_size", a.vocab_size},
          {"norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"max_seq_len", a.max_seq_len},
          {"tie_embeddings", a.tie_embeddings},
          {"inter_dim", a.inter_dim},
          {"moe_inter_dim", a.moe_inter_dim},
          {"n_dense_layers", a.n_dense_layers},
          {"n_routed_experts", a.n_routed_experts},
          {"n_shared_experts", a.n_shared_experts},
          {"n_activated_experts", a.n_activated_experts},
          {"n_expert_groups", a.n_expert_groups},
          {"n_limited_groups", a.n_limited_groups},
          {"score_sigmoid", a.score_sigmoid},
          {"norm_topk_prob", a.norm_topk_prob},
          {"route_scale", a.route_scale},
          {"load_balance_coeff", a.load_balance_coeff},
          {"q_lora_rank", a.q_lora_rank},
          {"kv_lora_rank", a.kv_lora_rank},
          {"qk_nope_head_dim", a.qk_nope_head_dim},
          {"qk_rope_head_dim", a.qk_rope_head_dim},
          {"v_head_dim", a.v_head_dim_},
          {"rope_interleave", a.rope_interleave},
          {"rope_factor", a.rope_factor},
          {"original_seq_len", a.original_seq_len},
          {"beta_fast", a.beta_fast},
          {"beta_slow", a.beta_slow},
          {"mscale", a.mscale},
          {"mscale_all_dim", a.mscale_all_dim}};
}

ModelArgs model_args_from_json(const nlohmann::json& j, const std::string& source) {
  LOOM_REQUIRE_USAGE(j.is_object(), source, ": model args must be a JSON object");
  ModelArgs a;
  try {
    for (const auto& item : j.items()) {
      const std::string key = item.key();
      const nlohmann::json& value = item.value();
      auto set = [&](const char* name, auto& field) {
        if (key != name) return false;
        field = value.get<std::decay_t<decltype(field)>>();
        return true;
      };
      const bool known =
          set("dim", a.dim) || set("n_layers", a.n_layers) || set("n_heads", a.n_heads) ||
          set("vocab_size", a.vocab_size) || set("norm_eps", a.norm_eps) || set("rope_theta", a.rope_theta) ||
          set("max_seq_len", a.max_seq_len) || set("tie_embeddings", a.tie_embeddings) ||
          set("inter_dim", a.inter_dim) || set("moe_inter_dim", a.moe_inter_dim) ||
          set("n_dense_layers", a.n_dense_layers) || set("n_routed_experts", a.n_routed_experts) ||
          set("n_shared_experts", a.n_shared_experts) || set("n_activated_experts", a.n_activated_experts) ||
          set("n_expert_groups", a.n_expert_groups) || set("n_limited_groups", a.n_limited_groups) ||
          set("score_sigmoid", a.score_sigmoid) || set("norm_topk_prob", a.norm_topk_prob) ||
          set("route_scale", a.route_scale) || set("load_balance_coeff", a.load_balance_coeff) ||
          set("q_lora_rank", a.q_lora_rank) || set("kv_lora_rank", a.kv_lora_rank) ||
          set("qk_nope_head_dim", a.qk_nope_head_dim) || set("qk_rope_head_dim", a.qk_rope_head_dim) ||
          set("v_head_dim", a.v_head_dim_) || set("rope_interleave", a.rope_interleave) ||
          set("rope_factor", a.rope_factor) || set("original_seq_len", a.original_seq_len) ||
          set("beta_fast", a.beta_fast) || set("beta_slow", a.beta_slow) || set("mscale", a.mscale) ||
          set("mscale_all_dim", a.mscale_all_dim);
      LOOM_REQUIRE_USAGE(known, source, ": unknown DeepSeek-V3 model arg '", key, "'");
    }
  } catch (const nlohmann::json::exception& e) {
    fail_usage(source, ": bad model args (", e.what(), ")");
  }
  a.n_kv_heads = a.n_heads;
  a.fixed_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim;
  try {
    a.validate();
  } catch (const UsageError& e) {
    fail_usage(source, ": ", e.what());
  }
  return a;
}

models::ParameterCounts count_parameters(const ModelArgs& a) {
  const int64_t qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
  const int64_t queries = a.q_lora_rank == 0 ? a.dim * a.n_heads * qk
                                             : a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.n_heads * qk;
  const int64_t attention = queries + a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank +
                            a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim_) +
                            a.n_heads * a.v_head_dim_ * a.dim;
  const int64_t expert = 3 * a.dim * a.moe_inter_dim;
  const int64_t dense_ffn = 3 * a.dim * a.inter_dim;
  const int64_t sparse_ffn = a.n_routed_experts * expert + a.n_shared_experts * expert + a.n_routed_experts * a.dim;
  const int64_t sparse_layers = a.n_layers - a.n_dense_layers;
  models::ParameterCounts c;
  c.embedding = a.vocab_size * a.dim;
  c.total = c.embedding + a.n_layers * (attention + 2 * a.dim) + a.n_dense_layers * dense_ffn +
            sparse_layers * sparse_ffn + a.dim + (a.tie_embeddings ? 0 : a.vocab_size * a.dim);
  c.non_embedding = c.total - c.embedding;
  c.active = c.total - sparse_layers * (a.n_routed_experts - a.n_activated_experts) * expert;
  return c;
}

DeepSeekV3Block::DeepSeekV3Block(int64_t layer_id, const ModelArgs& args, const torch::TensorOptions& options)
    : models::DecoderBlock("DeepSeekV3Block", layer_id) {
  attention_norm_ = register_module("attention_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  attention_ = register_module("attention",
                               std::make_shared<nn::MultiHeadLatentAttention>(args.dim, args.mla_options(), options));
  ffn_norm_ = register_module("ffn_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  if (args.is_sparse(layer_id)) {
    moe_ = register_module("moe", std::make_shared<moe::MoE>(args.dim, args.moe_options(), options));
  } else {
    feed_forward_ = register_module("feed_forward", std::make_shared<nn::FeedForward>(args.dim, args.inter_dim, options));
  }
}

torch::Tensor DeepSeekV3Block::forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                                       const nn::TokenLayout& layout) {
  // The lambda owns its arguments so activation checkpointing may re-run it.
  return call_with_hooks(x, [this, rope_cache, layout](const torch::Tensor& in) {
    const torch::Tensor attended = attention_->forward(attention_norm_->forward(in), rope_cache, layout);
    auto [h, normed] = ffn_norm_->add_and_forward(in, attended);
    return h + (moe_ ? moe_->forward(normed) : feed_forward_->forward(normed));
  });
}

DeepSeekV3::DeepSeekV3(ModelArgs args, const torch::TensorOptions& options)
    : models::Decoder("DeepSeekV3", std::make_shared<const ModelArgs>(std::move(args)),
                      [](int64_t layer_id, const models::DecoderArgs& d, const torch::TensorOptions& o)
                          -> std::shared_ptr<models::DecoderBlock> {
                        return std::make_shared<DeepSeekV3Block>(layer_id, static_cast<const ModelArgs&>(d), o);
                      },
                      options),
      args_(static_cast<const ModelArgs&>(decoder_args())) {}

nn::ParameterInit DeepSeekV3::parameter_init(const std::string& name) const {
  constexpr double kStd = 0.02;
  const double head_std = 1.0 / std::sqrt(static_cast<double>(args_.dim));
  if (name == "tok_embeddings.weight") return nn::ParameterInit::normal(1.0);
  if (name == "output.weight") return nn::ParameterInit::truncated_normal(head_std, -3 * head_std, 3 * head_std);
  if (name == "norm.weight") return nn::ParameterInit::ones();
  const auto layer = models::split_layer_name(name);
  LOOM_REQUIRE(layer.has_value(), "no DeepSeek-V3 initializer for parameter '", name, "'");
  const std::string& rest = layer->second;
  static const std::set<std::string> ones = {"attention_norm.weight", "ffn_norm.weight", "attention.q_norm.weight",
                                             "attention.kv_norm.weight"};
  static const std::set<std::string> input = {"attention.wq.weight",     "attention.wq_a.weight",
                                              "attention.wq_b.weight",   "attention.wkv_a.weight",
                                              "attention.wkv_b.weight",  "feed_forward.w1.weight",
                                              "moe.experts.w1",          "moe.shared_experts.w1.weight"};
  static const std::set<std::string> output = {"attention.wo.weight",          "feed_forward.w2.weight",
                                               "feed_forward.w3.weight",       "moe.experts.w2",
                                               "moe.experts.w3",               "moe.shared_experts.w2.weight",
                                               "moe.shared_experts.w3.weight", "moe.router.gate.weight"};
  if (ones.count(rest)) return nn::ParameterInit::ones();
  if (input.count(rest)) return nn::ParameterInit::truncated_normal(kStd, -2.0, 2.0);
  if (output.count(rest)) {
    return nn::ParameterInit::truncated_normal(kStd / std::sqrt(2.0 * static_cast<double>(layer->first + 1)), -2.0, 2.0);
  }
  fail("no DeepSeek-V3 initializer for parameter '", name, "'");
}

}  // namespace loom::deepseek_v3
