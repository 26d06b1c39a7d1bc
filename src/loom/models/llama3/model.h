// The Llama 3 decoder-only transformer: the shared decoder (models/common/decoder.h) with
// TransformerBlocks, in TorchTitan's module layout:
//   tok_embeddings, layers.{i}.{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm,
//   feed_forward.{w1,w2,w3}}, norm, output (untied from tok_embeddings).
// What is Llama's own: its args (model_args.h) and its initialization (parameter_init).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>

#include "loom/models/common/decoder.h"
#include "loom/models/llama3/model_args.h"

namespace loom::llama3 {

using models::TransformerBlock;

class Transformer : public models::Decoder {
 public:
  // Parameters are created (uninitialized) with `options`: pass torch::kMeta as the device to
  // build any flavor without allocating, then to_empty(device) and init_weights(seed).
  explicit Transformer(ModelArgs args, const torch::TensorOptions& options = torch::TensorOptions());

  nn::ParameterInit parameter_init(const std::string& name) const override;
  const ModelArgs& args() const { return args_; }

 private:
  const ModelArgs& args_;  // owned by the Decoder
};

// TorchTitan's initialization of parameter `name` (a dotted name of Transformer):
//   tok_embeddings: normal(0, 1); norms: ones; wq/wk/wv/w1: trunc_normal(0.02, [-2, 2]);
//   wo/w2/w3: trunc_normal(0.02 / sqrt(2 (layer_id + 1))) with depth_init, else
//   0.02 / sqrt(2 n_layers); output: trunc_normal(dim^-0.5, +-3 std).
nn::ParameterInit parameter_init(const ModelArgs& args, const std::string& name);

using models::ParameterCounts;
using models::count_parameters;
using models::flops_per_token;
// total, embedding (tok_embeddings only: the untied output head counts as compute), non_embedding,
// from the shapes alone (no model needed).
ParameterCounts count_parameters(const ModelArgs& args);

}  // namespace loom::llama3
