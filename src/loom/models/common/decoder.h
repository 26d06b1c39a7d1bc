// The decoder-only transformer every model family shares (TorchTitan's per-model Transformer
// shells, written once): token embedding, a stack of blocks keyed by layer id, final RMSNorm and
// an output head (or the embedding read back as the head when the family ties them), the fused
// chunked head + loss, the pipeline parts (forward_part) and initialization by global parameter
// names. A family supplies its hyper-parameters (a DecoderArgs), its block (a DecoderBlock; the
// pre-norm TransformerBlock here covers Llama 3 and Qwen3) and its initialization table.
//
// Parameter names, whatever the family: tok_embeddings.weight, layers.<i>.<block's own names>,
// norm.weight, output.weight (absent when tied). Build on the meta device to plan or count
// without memory, then to_empty() + init_weights().
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/models/model_args.h"
#include "loom/nn/attention.h"
#include "loom/nn/init.h"
#include "loom/nn/layers.h"
#include "loom/nn/module.h"
#include "loom/nn/rope.h"

namespace loom::models {

// What the shared decoder and its parallelization read of a family's hyper-parameters. A family's
// args derive from it and add what only they need (llama3: the FFN size rule, the RoPE scaling).
struct DecoderArgs : ModelArgs {
  int64_t dim = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t vocab_size = 0;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  int64_t max_seq_len = 0;  // length of the precomputed RoPE cache
  // Qwen3 states the head width; unset: dim / n_heads (Llama).
  std::optional<int64_t> fixed_head_dim;
  // The output head is the token embedding (no output.weight; Qwen3 0.6B-4B, Llama 3.2 1B/3B).
  bool tie_embeddings = false;
  // QK-norm in every attention (nn::AttentionOptions::qk_norm_eps, with norm_eps).
  bool qk_norm = false;

  int64_t head_dim() const { return fixed_head_dim.value_or(n_heads > 0 ? dim / n_heads : 0); }
  virtual int64_t ffn_hidden_dim() const = 0;
  // The routed experts of each MoE layer (what expert parallelism splits); 0: a dense model.
  virtual int64_t routed_experts() const { return 0; }
  // RoPE frequency scaling (Llama 3.1's); none by default.
  virtual std::optional<nn::RopeScaling> rope_scaling_or_none() const { return std::nullopt; }
  // The attention core's head widths (multi-head latent attention's differ) and key/value heads:
  // what the FLOPs, a KV cache and context parallelism see. Default: head_dim and n_kv_heads.
  virtual int64_t qk_head_dim() const { return head_dim(); }
  virtual int64_t v_head_dim() const { return head_dim(); }
  virtual int64_t attention_kv_heads() const { return n_kv_heads; }
  // The options of layer `layer_id`'s attention (TransformerBlock, MoETransformerBlock): head_dim
  // and the QK-norm by default. A family overrides it to turn on GPT-OSS's features per layer
  // (sinks, a sliding window on some layers, biased projections: nn::AttentionOptions).
  virtual nn::AttentionOptions attention_options(int64_t layer_id) const;
  // The rotated width of a head (MLA rotates only its rope part) and the decoder's RoPE cache
  // [2, max_seq_len, rope_dim()] (nn/rope.h's layout). Default: head_dim() with
  // rope_scaling_or_none().
  virtual int64_t rope_dim() const { return head_dim(); }
  virtual torch::Tensor rope_cache_values() const;
  // Throws loom::UsageError naming the first inconsistent field. Families extend it.
  virtual void validate() const;
};

// One block of the stack. The decoder passes every block the same RoPE cache and token layout.
class DecoderBlock : public nn::Module {
 public:
  DecoderBlock(std::string type_name, int64_t layer_id) : nn::Module(std::move(type_name)), layer_id_(layer_id) {}
  // x: [B, T, dim] -> [B, T, dim]. The forward handed to an around-hook (nn::ForwardOverride) must
  // own copies of rope_cache and layout, so the hook may re-run it after the call returns (AC).
  virtual torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                                const nn::TokenLayout& layout) = 0;
  // The block's self-attention, whose core parallelisms and the KV cache replace from outside.
  virtual nn::SelfAttention& attention() = 0;
  // Sets the block's buffers on their device after materialization (to_empty): an MoE block's
  // routing state starts at zero. Called by Decoder::reset_buffers.
  virtual void reset_buffers() {}
  int64_t layer_id() const { return layer_id_; }

 private:
  int64_t layer_id_;
};

// The pre-norm block of Llama 3 and Qwen3: x + attention(attention_norm(x)), then
// + feed_forward(ffn_norm(.)) with a SwiGLU feed-forward. Names: attention_norm,
// attention.{wq,wk,wv,wo[,q_norm,k_norm]}, ffn_norm, feed_forward.{w1,w2,w3}.
class TransformerBlock : public DecoderBlock {
 public:
  TransformerBlock(int64_t layer_id, const DecoderArgs& args, const torch::TensorOptions& options);

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                        const nn::TokenLayout& layout = {}) override;

  nn::RMSNorm& attention_norm() { return *attention_norm_; }
  nn::Attention& attention() override { return *attention_; }
  nn::RMSNorm& ffn_norm() { return *ffn_norm_; }
  nn::FeedForward& feed_forward() { return *feed_forward_; }

 private:
  std::shared_ptr<nn::RMSNorm> attention_norm_;
  std::shared_ptr<nn::Attention> attention_;
  std::shared_ptr<nn::RMSNorm> ffn_norm_;
  std::shared_ptr<nn::FeedForward> feed_forward_;
};

class Decoder : public nn::Module {
 public:
  // Builds block `layer_id` of the stack with the decoder's tensor options.
  using BlockFactory = std::function<std::shared_ptr<DecoderBlock>(int64_t layer_id, const DecoderArgs& args,
                                                                     const torch::TensorOptions& options)>;

  // Parameters are created (uninitialized) with `options`: pass torch::kMeta as the device to
  // build any flavor without allocating, then to_empty(device) and init_weights(seed).
  Decoder(std::string type_name, std::shared_ptr<const DecoderArgs> args, const BlockFactory& make_block,
          const torch::TensorOptions& options);

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

  // ---- Parts of the model (a pipeline stage is a Decoder with some parts removed) ----
  // Removes tok_embeddings (inputs are then hidden states [B, T, dim]) / norm and output (outputs
  // are then hidden states), and layers through layers().remove_module(id): the remaining layers
  // keep their ids, so parameter names stay those of the whole model. Nothing here knows about
  // ranks: which parts a stage keeps is decided outside (common/pipeline.h). A tied decoder's
  // head is its embedding, so it cannot lose one part without the other.
  void remove_embedding();
  void remove_head();
  bool has_embedding() const { return tok_embeddings_ != nullptr; }
  bool has_head() const { return norm_ != nullptr; }
  // Whatever parts are present, in order: tokens [B, T] (int64) with the embedding, else hidden
  // [B, T, dim] -> the layers -> with the head, the training loss of `labels` [B, T] exactly as
  // forward_loss computes it (fused chunked head + loss, or the installed HeadLoss), else the
  // hidden states [B, T, dim]. The whole model's forward_part(tokens, labels) is forward_loss.
  torch::Tensor forward_part(const torch::Tensor& input, const torch::Tensor& labels,
                             const nn::TokenLayout& layout = {});

  // The family's initialization of parameter `name` (a dotted global name), read by
  // init_weights and by sharded materializations drawing one full parameter at a time.
  virtual nn::ParameterInit parameter_init(const std::string& name) const = 0;
  // Initializers of parameters added from outside the family (LoRA adapters), consulted before
  // parameter_init: the first that knows a name decides.
  using Initializer = std::function<std::optional<nn::ParameterInit>(const std::string& name)>;
  void add_initializer(Initializer initializer) { initializers_.push_back(std::move(initializer)); }
  // What initializes parameter `name`: an added initializer's answer, else parameter_init(name).
  nn::ParameterInit initializer(const std::string& name) const;
  // Initializes every parameter by name from `seed` and recomputes the RoPE cache. Identical
  // values whatever the device, dtype or later sharding.
  void init_weights(uint64_t seed);
  // Recomputes the non-persistent RoPE cache on the current device (after to_empty / to).
  void reset_buffers();

  // Replaces the loss computed from the final hidden states [B, T', dim] (after the final norm),
  // the head's weight (output.weight, or tok_embeddings.weight when tied) and the labels [B, T]:
  // a parallelization that shards the vocabulary installs its loss here (loss parallel). Unset:
  // the fused chunked head + loss.
  using HeadLoss = std::function<torch::Tensor(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                               const torch::Tensor& labels)>;
  void set_head_loss(HeadLoss loss) { head_loss_ = std::move(loss); }
  bool has_head_loss() const { return head_loss_ != nullptr; }

  const DecoderArgs& decoder_args() const { return *args_; }
  // tok_embeddings / norm / output throw loom::Error when the part was removed (output also when
  // tied: the head is tok_embeddings).
  nn::Embedding& tok_embeddings();
  nn::ModuleDict& layers() { return *layers_; }
  DecoderBlock& layer(const std::string& id);
  nn::RMSNorm& norm();
  nn::Linear& output();
  bool has_output() const { return output_ != nullptr; }
  // The head's weight [vocab, dim]: output.weight, or tok_embeddings.weight when tied.
  const torch::Tensor& head_weight();
  const torch::Tensor& rope_cache() const { return rope_cache_->tensor; }

 private:
  std::vector<Initializer> initializers_;
  std::shared_ptr<const DecoderArgs> args_;
  std::shared_ptr<nn::Embedding> tok_embeddings_;
  std::shared_ptr<nn::ModuleDict> layers_;
  std::shared_ptr<nn::RMSNorm> norm_;
  std::shared_ptr<nn::Linear> output_;  // null when tied
  nn::BufferSlot* rope_cache_;          // "freqs": [2, max_seq_len, head_dim], non-persistent
  HeadLoss head_loss_;

  // Output head and loss of the already-normed hidden states: the tail of forward_loss.
  torch::Tensor loss_from_normed(const torch::Tensor& hidden, const torch::Tensor& labels);
  void check_length(int64_t length) const;
};

// Counts from a built model: total, embedding (tok_embeddings only: an untied output head counts
// as compute), non_embedding.
ParameterCounts count_parameters(Decoder& model);
// The same numbers from the shapes alone, for a stack of TransformerBlocks.
ParameterCounts count_transformer_parameters(const DecoderArgs& args);

// TorchTitan's training FLOPs per token: 6 N + 12 L H d_head T, N = non-embedding parameters,
// T = sequence length. The attention term counts the QK^T and AV matmuls of forward and backward
// (2 + 4 matmuls, 2 FLOPs per multiply-add) and, by convention, ignores causal sparsity; a layer
// with a sliding window (attention_options) counts min(window, T) keys instead of T.
double flops_per_token(const DecoderArgs& args, int64_t non_embedding_params, int64_t seq_len);

// The one-line loom::UsageError for a flavor `family` does not have, listing `valid`.
[[noreturn]] void fail_unknown_flavor(const std::string& family, const std::string& name,
                                      const std::vector<std::string>& valid);

// Splits "layers.<id>.<rest>" into (id, rest); nullopt for any other name.
std::optional<std::pair<int64_t, std::string>> split_layer_name(const std::string& name);

}  // namespace loom::models
