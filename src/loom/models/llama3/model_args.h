// Llama 3 hyper-parameters and the named flavors (TorchTitan's debugmodel and Meta's published
// Llama 3.1 / 3.2 shapes).
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/models/common/decoder.h"
#include "loom/nn/rope.h"

namespace loom::llama3 {

// The shared decoder's fields (models::DecoderArgs: dim, n_layers, n_heads, n_kv_heads,
// vocab_size, norm_eps, rope_theta, max_seq_len) default to Llama 3.1 8B's; Llama's head is
// never tied and it has no QK-norm.
struct ModelArgs : models::DecoderArgs {
  ModelArgs();
  // SwiGLU hidden size, as Meta derives it: 2/3 * 4 * dim, times ffn_dim_multiplier, rounded up to
  // a multiple of multiple_of. `ffn_dim` > 0 overrides the derivation (Hugging Face configs state
  // intermediate_size directly).
  int64_t multiple_of = 256;
  std::optional<double> ffn_dim_multiplier;
  int64_t ffn_dim = 0;
  bool use_scaled_rope = true;  // Llama 3.1 frequency scaling (rope_scaling below)
  nn::RopeScaling rope_scaling;  // factor 8, low 1, high 4, original 8192 (3.2 uses factor 32)
  // TorchTitan's depth-scaled init: wo/w2/w3 std = 0.02 / sqrt(2 * (layer_id + 1)); when false,
  // 0.02 / sqrt(2 * n_layers) for every layer.
  bool depth_init = true;

  int64_t ffn_hidden_dim() const override;
  std::optional<nn::RopeScaling> rope_scaling_or_none() const override {
    return use_scaled_rope ? std::optional<nn::RopeScaling>(rope_scaling) : std::nullopt;
  }
  // Throws loom::UsageError naming the first inconsistent field.
  void validate() const override;
  std::string summary() const override;  // "dim 4096, 32 layers, 32 heads (8 kv), ffn 14336, vocab 128256"
};

// Named flavors, as listed by flavor_names(): debugmodel, tiny, 124M, 1B, 3B, 8B, 70B, 405B.
// `vocab_size` overrides the flavor's (the debug model's vocabulary comes from the tokenizer;
// default 2048). Unknown names throw a loom::UsageError listing the valid ones.
//
// Loom's output head is always untied from tok_embeddings. Meta ties them in Llama 3.2 1B/3B, so
// those flavors here have vocab_size * dim more parameters than the published counts
// (1B: 1.50e9 instead of 1.24e9).
ModelArgs flavor(const std::string& name, std::optional<int64_t> vocab_size = std::nullopt);
std::vector<std::string> flavor_names();

// Loom's own JSON form (every field above), used by the Loom model directory's config.json.
nlohmann::json to_json(const ModelArgs& args);
// `source` names the file for error messages; unknown keys are an error (typos must not pass).
ModelArgs model_args_from_json(const nlohmann::json& json, const std::string& source);

}  // namespace loom::llama3
