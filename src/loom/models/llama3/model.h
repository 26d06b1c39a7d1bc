// The Llama 3 decoder-only transformer, in TorchTitan's module layout:
//   tok_embeddings, layers.{i}.{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm,
//   feed_forward.{w1,w2,w3}}, norm, output (untied from tok_embeddings).
// Build on the meta device to plan or count without memory, then to_empty() + init_weights().
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "loom/models/llama3/model_args.h"
#include "loom/nn/attention.h"
#include "loom/nn/init.h"
#include "loom/nn/layers.h"
#include "loom/nn/module.h"

namespace loom::llama3 {

class TransformerBlock : public nn::Module {
 public:
  TransformerBlock(int64_t layer_id, const ModelArgs& args, const torch::TensorOptions& options);

  // x: [B, T, dim] -> [B, T, dim]: x + attn(norm(x)), then + ffn(norm(.)). The forward handed to
  // an around-hook (nn::ForwardOverride) owns copies of rope_cache and layout, so the hook may
  // keep it and re-run it after this call returns (activation checkpointing).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                        const nn::TokenLayout& layout = {});

  int64_t layer_id() const { return layer_id_; }
  nn::RMSNorm& attention_norm() { return *attention_norm_; }
  nn::Attention& attention() { return *attention_; }
  nn::RMSNorm& ffn_norm() { return *ffn_norm_; }
  nn::FeedForward& feed_forward() { return *feed_forward_; }

 private:
  int64_t layer_id_;
  std::shared_ptr<nn::RMSNorm> attention_norm_;
  std::shared_ptr<nn::Attention> attention_;
  std::shared_ptr<nn::RMSNorm> ffn_norm_;
  std::shared_ptr<nn::FeedForward> feed_forward_;
};

class Transformer : public nn::Module {
 public:
  // Parameters are created (uninitialized) with `options`: pass torch::kMeta as the device to
  // build any flavor without allocating, then to_empty(device) and init_weights(seed).
  explicit Transformer(ModelArgs args,
                       const torch::TensorOptions& options = torch::TensorOptions());

  // tokens [B, T] int64 -> logits [B, T, vocab_size] (in the parameters' dtype).
  torch::Tensor forward(const torch::Tensor& tokens);
  // Training loss: mean next-token cross-entropy of `labels` [B, T] (int64, -100 = ignore). The
  // final norm, output head and loss run fused over token chunks (nn::fused_linear_cross_entropy):
  // the [B*T, vocab] logits are never materialised. Same forward hooks as forward().
  // `layout`: the tokens' positions and documents (nn::TokenLayout; default: causal rows 0..T-1).
  torch::Tensor forward_loss(const torch::Tensor& tokens, const torch::Tensor& labels,
                             const nn::TokenLayout& layout = {});
  // The pieces of forward, for callers that need the hidden states (loss fusion, pipelining).
  torch::Tensor embed(const torch::Tensor& tokens);
  torch::Tensor run_layers(torch::Tensor hidden, const nn::TokenLayout& layout = {});
  torch::Tensor head(const torch::Tensor& hidden);  // final norm + output projection

  // ---- Parts of the model (a pipeline stage is a Transformer with some parts removed) ----
  // Removes tok_embeddings (inputs are then hidden states [B, T, dim]) / norm and output (outputs
  // are then hidden states), and layers through layers().remove_module(id): the remaining layers
  // keep their ids, so parameter names stay those of the whole model. Nothing here knows about
  // ranks: which parts a stage keeps is decided outside (llama3/pipeline.h).
  void remove_embedding();
  void remove_head();
  bool has_embedding() const { return tok_embeddings_ != nullptr; }
  bool has_head() const { return output_ != nullptr; }
  // Whatever parts are present, in order: tokens [B, T] (int64) with the embedding, else hidden
  // [B, T, dim] -> the layers -> with the head, the training loss of `labels` [B, T] exactly as
  // forward_loss computes it (fused chunked head + loss, or the installed HeadLoss), else the
  // hidden states [B, T, dim]. The whole model's forward_part(tokens, labels) is forward_loss.
  // `layout` as forward_loss's (pipeline stages pass each micro-batch's document ids).
  torch::Tensor forward_part(const torch::Tensor& input, const torch::Tensor& labels,
                             const nn::TokenLayout& layout = {});

  // Initializes every parameter by name (see parameter_init) from `seed` and recomputes the RoPE
  // cache. Identical values whatever the device, dtype or later sharding.
  void init_weights(uint64_t seed);
  // Recomputes the non-persistent RoPE cache on the current device (after to_empty / to).
  void reset_buffers();

  // Replaces the loss forward_loss computes from the final hidden states [B, T', dim] (after the
  // final norm), the output head and the labels [B, T]: a parallelization that shards the
  // vocabulary installs its loss here (loss parallel). Unset: the fused chunked head + loss.
  using HeadLoss = std::function<torch::Tensor(const torch::Tensor& hidden, nn::Linear& output,
                                               const torch::Tensor& labels)>;
  void set_head_loss(HeadLoss loss) { head_loss_ = std::move(loss); }

  const ModelArgs& args() const { return args_; }
  // tok_embeddings / norm / output throw loom::Error when the part was removed.
  nn::Embedding& tok_embeddings();
  nn::ModuleDict& layers() { return *layers_; }
  nn::RMSNorm& norm();
  nn::Linear& output();
  const torch::Tensor& rope_cache() const { return rope_cache_->tensor; }

 private:
  ModelArgs args_;
  std::shared_ptr<nn::Embedding> tok_embeddings_;
  std::shared_ptr<nn::ModuleDict> layers_;
  std::shared_ptr<nn::RMSNorm> norm_;
  std::shared_ptr<nn::Linear> output_;
  nn::BufferSlot* rope_cache_;  // "freqs": [2, max_seq_len, head_dim], non-persistent
  HeadLoss head_loss_;

  // Final norm (already applied to `hidden`), output head and loss: the tail of forward_loss.
  torch::Tensor loss_from_normed(const torch::Tensor& hidden, const torch::Tensor& labels);
};

// TorchTitan's initialization of parameter `name` (a dotted name of Transformer):
//   tok_embeddings: normal(0, 1); norms: ones; wq/wk/wv/w1: trunc_normal(0.02, [-2, 2]);
//   wo/w2/w3: trunc_normal(0.02 / sqrt(2 (layer_id + 1))) with depth_init, else
//   0.02 / sqrt(2 n_layers); output: trunc_normal(dim^-0.5, +-3 std).
// Public so a sharded materialization can draw a parameter's full value on its own.
nn::ParameterInit parameter_init(const ModelArgs& args, const std::string& name);

// total, embedding (tok_embeddings only: the untied output head counts as compute), non_embedding.
using models::ParameterCounts;
ParameterCounts count_parameters(Transformer& model);
// Same numbers from the shapes alone (no model needed).
ParameterCounts count_parameters(const ModelArgs& args);

// TorchTitan's training FLOPs per token: 6 N + 12 L H d_head T, N = non-embedding parameters,
// T = sequence length. The attention term counts the QK^T and AV matmuls of forward and backward
// (2 + 4 matmuls, 2 FLOPs per multiply-add) and, by convention, ignores causal sparsity.
double flops_per_token(const ModelArgs& args, int64_t non_embedding_params, int64_t seq_len);

}  // namespace loom::llama3
