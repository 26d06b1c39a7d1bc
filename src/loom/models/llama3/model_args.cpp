#include "loom/models/llama3/model_args.h"

#include <nlohmann/json.hpp>

#include <set>

#include "loom/core/error.h"

namespace loom::llama3 {

ModelArgs::ModelArgs() {
  dim = 4096;
  n_layers = 32;
  n_heads = 32;
  n_kv_heads = 8;
  vocab_size = 128256;
  norm_eps = 1e-5;
  rope_theta = 500000.0;
  max_seq_len = 8192;
}

int64_t ModelArgs::ffn_hidden_dim() const {
  if (ffn_dim > 0) return ffn_dim;
  // Meta's FeedForward: int(2 * 4dim / 3), scaled, rounded up to multiple_of.
  int64_t hidden = 2 * (4 * dim) / 3;
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * hidden);
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

void ModelArgs::validate() const {
  LOOM_REQUIRE_USAGE(dim > 0 && n_layers > 0 && n_heads > 0 && n_kv_heads > 0 && vocab_size > 0,
                     "model dims must be positive (dim ", dim, ", n_layers ", n_layers,
                     ", n_heads ", n_heads, ", n_kv_heads ", n_kv_heads, ", vocab_size ",
                     vocab_size, ")");
  LOOM_REQUIRE_USAGE(dim % n_heads == 0, "dim ", dim, " is not divisible by n_heads ", n_heads);
  LOOM_REQUIRE_USAGE(head_dim() % 2 == 0, "head_dim ", head_dim(), " (dim / n_heads) must be even for RoPE");
  LOOM_REQUIRE_USAGE(n_heads % n_kv_heads == 0, "n_heads ", n_heads,
                     " is not a multiple of n_kv_heads ", n_kv_heads);
  LOOM_REQUIRE_USAGE(ffn_dim > 0 || multiple_of > 0, "multiple_of must be positive, got ",
                     multiple_of);
  LOOM_REQUIRE_USAGE(!ffn_dim_multiplier || *ffn_dim_multiplier > 0,
                     "ffn_dim_multiplier must be positive");
  LOOM_REQUIRE_USAGE(norm_eps > 0, "norm_eps must be positive, got ", norm_eps);
  LOOM_REQUIRE_USAGE(rope_theta > 1, "rope_theta must be > 1, got ", rope_theta);
  LOOM_REQUIRE_USAGE(max_seq_len > 0, "max_seq_len must be positive, got ", max_seq_len);
  if (use_scaled_rope) {
    const auto& s = rope_scaling;
    LOOM_REQUIRE_USAGE(s.factor >= 1 && s.low_freq_factor > 0 &&
                           s.high_freq_factor > s.low_freq_factor && s.original_max_position > 0,
                       "invalid rope_scaling (factor ", s.factor, ", low_freq_factor ",
                       s.low_freq_factor, ", high_freq_factor ", s.high_freq_factor,
                       ", original_max_position ", s.original_max_position, ")");
  }
}

std::string ModelArgs::summary() const {
  return c10::str("dim ", dim, ", ", n_layers, " layers, ", n_heads, " heads (", n_kv_heads,
                  " kv), head_dim ", head_dim(), ", ffn ", ffn_hidden_dim(), ", vocab ",
                  vocab_size, ", rope_theta ", rope_theta,
                  use_scaled_rope ? c10::str(" (llama3-scaled x", rope_scaling.factor, ")")
                                  : std::string());
}

std::vector<std::string> flavor_names() {
  return {"debugmodel", "tiny", "124M", "1B", "3B", "8B", "70B", "405B"};
}

ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size) {
  ModelArgs a;
  a.multiple_of = 256;
  a.norm_eps = 1e-5;
  a.rope_theta = 500000.0;
  a.use_scaled_rope = true;
  a.vocab_size = 128256;
  a.max_seq_len = 8192;
  if (name == "debugmodel") {  // TorchTitan's: full attention heads, tokenizer-sized vocab
    a.dim = 256, a.n_layers = 6, a.n_heads = 16, a.n_kv_heads = 16;
    a.vocab_size = 2048;
    a.max_seq_len = 2048;
  } else if (name == "tiny") {  // the layout-parity tests' model: the smallest shape every layout
                                // splits (TP 4, CP 4, 4 pipeline stages, float8's multiples of 16)
    a.dim = 64, a.n_layers = 4, a.n_heads = 4, a.n_kv_heads = 4;
    a.vocab_size = 2048;
    a.max_seq_len = 2048;
  } else if (name == "124M") {  // GPT-2-small-sized Llama 3 for the throughput benchmark (bench/)
    a.dim = 768, a.n_layers = 12, a.n_heads = 12, a.n_kv_heads = 4;
    a.vocab_size = 32000;
    a.max_seq_len = 2048;
  } else if (name == "1B") {  // Llama 3.2 1B (Meta ties the head; Loom does not)
    a.dim = 2048, a.n_layers = 16, a.n_heads = 32, a.n_kv_heads = 8;
    a.ffn_dim_multiplier = 1.5;
    a.rope_scaling.factor = 32.0;
  } else if (name == "3B") {  // Llama 3.2 3B (tied by Meta, untied here)
    a.dim = 3072, a.n_layers = 28, a.n_heads = 24, a.n_kv_heads = 8;
    a.ffn_dim_multiplier = 1.0;
    a.rope_scaling.factor = 32.0;
  } else if (name == "8B") {  // Llama 3.1 8B
    a.dim = 4096, a.n_layers = 32, a.n_heads = 32, a.n_kv_heads = 8;
    a.ffn_dim_multiplier = 1.3, a.multiple_of = 1024;
  } else if (name == "70B") {
    a.dim = 8192, a.n_layers = 80, a.n_heads = 64, a.n_kv_heads = 8;
    a.ffn_dim_multiplier = 1.3, a.multiple_of = 4096;
  } else if (name == "405B") {
    a.dim = 16384, a.n_layers = 126, a.n_heads = 128, a.n_kv_heads = 8;
    a.ffn_dim_multiplier = 1.2, a.multiple_of = 4096;
  } else {
    models::fail_unknown_flavor("Llama 3", name, flavor_names());
  }
  if (vocab_size) a.vocab_size = *vocab_size;
  a.validate();
  return a;
}

nlohmann::json to_json(const ModelArgs& a) {
  nlohmann::json j = {
      {"dim", a.dim},
      {"n_layers", a.n_layers},
      {"n_heads", a.n_heads},
      {"n_kv_heads", a.n_kv_heads},
      {"vocab_size", a.vocab_size},
      {"multiple_of", a.multiple_of},
      {"ffn_dim_multiplier", nullptr},
      {"ffn_dim", a.ffn_dim},
      {"norm_eps", a.norm_eps},
      {"rope_theta", a.rope_theta},
      {"use_scaled_rope", a.use_scaled_rope},
      {"rope_scaling",
       {{"factor", a.rope_scaling.factor},
        {"low_freq_factor", a.rope_scaling.low_freq_factor},
        {"high_freq_factor", a.rope_scaling.high_freq_factor},
        {"original_max_position", a.rope_scaling.original_max_position}}},
      {"max_seq_len", a.max_seq_len},
      {"depth_init", a.depth_init},
  };
  if (a.ffn_dim_multiplier) j["ffn_dim_multiplier"] = *a.ffn_dim_multiplier;
  return j;
}

ModelArgs model_args_from_json(const nlohmann::json& j, const std::string& source) {
  LOOM_REQUIRE_USAGE(j.is_object(), source, ": model args must be a JSON object");
  static const std::set<std::string> known = {
      "dim",        "n_layers",        "n_heads",      "n_kv_heads", "vocab_size",
      "multiple_of", "ffn_dim_multiplier", "ffn_dim", "norm_eps",   "rope_theta",
      "use_scaled_rope", "rope_scaling", "max_seq_len", "depth_init"};
  for (const auto& [key, value] : j.items()) {
    LOOM_REQUIRE_USAGE(known.count(key) > 0, source, ": unknown model arg '", key, "'");
  }
  ModelArgs a;
  try {
    auto get = [&](const char* key, auto& field) {
      if (j.contains(key)) field = j.at(key).get<std::decay_t<decltype(field)>>();
    };
    get("dim", a.dim);
    get("n_layers", a.n_layers);
    get("n_heads", a.n_heads);
    a.n_kv_heads = a.n_heads;
    get("n_kv_heads", a.n_kv_heads);
    get("vocab_size", a.vocab_size);
    get("multiple_of", a.multiple_of);
    if (j.contains("ffn_dim_multiplier") && !j.at("ffn_dim_multiplier").is_null()) {
      a.ffn_dim_multiplier = j.at("ffn_dim_multiplier").get<double>();
    }
    get("ffn_dim", a.ffn_dim);
    get("norm_eps", a.norm_eps);
    get("rope_theta", a.rope_theta);
    get("use_scaled_rope", a.use_scaled_rope);
    if (j.contains("rope_scaling")) {
      const auto& s = j.at("rope_scaling");
      if (s.contains("factor")) a.rope_scaling.factor = s.at("factor").get<double>();
      if (s.contains("low_freq_factor")) {
        a.rope_scaling.low_freq_factor = s.at("low_freq_factor").get<double>();
      }
      if (s.contains("high_freq_factor")) {
        a.rope_scaling.high_freq_factor = s.at("high_freq_factor").get<double>();
      }
      if (s.contains("original_max_position")) {
        a.rope_scaling.original_max_position = s.at("original_max_position").get<int64_t>();
      }
    }
    get("max_seq_len", a.max_seq_len);
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

}  // namespace loom::llama3
