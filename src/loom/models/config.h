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
  nn::AttentionMask attention_mask = nn::AttentionMask::kCausal;

  bool operator==(const ModelConfig&) const = default;
};
const options::Section& model_section();

}  // namespace loom::models
