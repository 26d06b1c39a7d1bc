// The [model] section of a job config: which registered family and flavor to train, its tokenizer
// and the overrides of the flavor's shape.
#pragma once
#include <cstdint>
#include <string>

#include "loom/core/options.h"
#include "loom/nn/attention.h"

namespace loom::models {

struct ModelConfig {
  std::string name = "llama3";  // a registered family (registry.cpp)
  std::string flavor = "debugmodel";
  std::string tokenizer_path = "data/default/tokenizer.json";
  int64_t vocab_size = 0;  // 0 = the tokenizer's vocabulary size
  int64_t n_layers = 0;    // 0 = the flavor's
  std::string hf_config;   // flavor "hf": the config.json (or its directory); "" = initial_load_path's
  nn::AttentionMask attention_mask = nn::AttentionMask::kCausal;

  bool operator==(const ModelConfig&) const = default;
};
const options::Section& model_section();

struct ModelRequest;
// What a run with `model` asks of its spec's build_args (models/spec.h): the flavor with
// `vocab_size` rows (model.vocab_size, else the tokenizer's) and positions for `seq_len`, or, with
// model.flavor = "hf", the shape of the config.json that model.hf_config or
// `initial_load_path` (checkpoint.initial_load_path) names, which `vocab_size` must fit.
ModelRequest model_request(const ModelConfig& model, const std::string& initial_load_path, int64_t vocab_size,
                           int64_t seq_len);

}  // namespace loom::models
