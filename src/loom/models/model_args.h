// What every model's hyper-parameters share, as the Trainer sees them (TorchTitan's BaseModelArgs):
// a model's own args (llama3::ModelArgs, ...) derive from ModelArgs, and only its spec
// (models/spec.h) reads their fields.
#pragma once
#include <cstdint>
#include <string>

namespace loom::models {

class ModelArgs {
 public:
  virtual ~ModelArgs() = default;
  // One line for the log: "dim 4096, 32 layers, ...".
  virtual std::string summary() const = 0;
};

struct ParameterCounts {
  int64_t total = 0;
  int64_t embedding = 0;      // the token embedding only (an untied output head counts as compute)
  int64_t non_embedding = 0;  // total - embedding: TorchTitan's N in 6N
  // What one token passes through: total for a dense model; an MoE model counts top_k of each
  // sparse layer's experts (its FLOPs per token and MFU use it).
  int64_t active = 0;
};

}  // namespace loom::models
