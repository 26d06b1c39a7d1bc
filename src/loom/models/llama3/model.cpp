#include "loom/models/llama3/model.h"

#include <ATen/record_function.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/nn/fused.h"
#include "loom/nn/rope.h"

namespace loom::llama3 {

TransformerBlock::TransformerBlock(int64_t layer_id, const ModelArgs& args,
                                   const torch::TensorOptions& options)
    : nn::Module("TransformerBlock"), layer_id_(layer_id) {
  attention_norm_ = register_module("attention_norm",
                                    std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  attention_ = register_module(
      "attention", std::make_shared<nn::Attention>(args.dim, args.n_heads, args.n_kv_heads, options));
  ffn_norm_ =
      register_module("ffn_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  feed_forward_ = register_module(
      "feed_forward", std::make_shared<nn::FeedForward>(args.dim, args.ffn_hidden_dim(), options));
}

torch::Tensor TransformerBlock::forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                                       const nn::TokenLayout& layout) {
  // The lambda owns its per-call arguments (copies of a few tensor handles): an around-hook may
  // keep it past this call and run it again in backward (activation checkpointing's recompute,
  // ac/activation_checkpoint.h), when the caller's rope_cache and layout references are gone.
  return call_with_hooks(x, [this, rope_cache, layout](const torch::Tensor& in) {
    torch::Tensor h = in + attention_->forward(attention_norm_->forward(in), rope_cache, layout);
    return h + feed_forward_->forward(ffn_norm_->forward(h));
  });
}

Transformer::Transformer(ModelArgs args, const torch::TensorOptions& options)
    : nn::Module("Transformer"), args_(std::move(args)) {
  args_.validate();
  tok_embeddings_ = register_module(
      "tok_embeddings", std::make_shared<nn::Embedding>(args_.vocab_size, args_.dim, options));
  layers_ = register_module("layers", std::make_shared<nn::ModuleDict>());
  for (int64_t i = 0; i < args_.n_layers; ++i) {
    layers_->add(std::to_string(i), std::make_shared<TransformerBlock>(i, args_, options));
  }
  norm_ = register_module("norm", std::make_shared<nn::RMSNorm>(args_.dim, args_.norm_eps, options));
  output_ = register_module("output",
                            std::make_shared<nn::Linear>(args_.dim, args_.vocab_size, options));
  // The RoPE cache stays fp32 whatever the parameter dtype (bf16 angles lose positions).
  const auto cache_options = options.dtype(torch::kFloat32).requires_grad(false);
  rope_cache_ = register_buffer(
      "freqs", torch::empty({2, args_.max_seq_len, args_.head_dim()}, cache_options),
      /*persistent=*/false);
  if (!rope_cache_->tensor.is_meta()) reset_buffers();
}

void Transformer::reset_buffers() {
  torch::Tensor& cache = rope_cache_->tensor;
  LOOM_REQUIRE(!cache.is_meta(), "cannot compute the RoPE cache on the meta device; call "
                                 "to_empty(device) first");
  torch::Tensor values = nn::rope_cache(
      nn::rope_inverse_frequencies(args_.head_dim(), args_.rope_theta, args_.rope_scaling_or_none()),
      args_.max_seq_len);
  cache = values.to(cache.device(), cache.scalar_type());
}

nn::Embedding& Transformer::tok_embeddings() {
  LOOM_REQUIRE(tok_embeddings_ != nullptr, "this Transformer has no tok_embeddings (removed)");
  return *tok_embeddings_;
}

nn::RMSNorm& Transformer::norm() {
  LOOM_REQUIRE(norm_ != nullptr, "this Transformer has no final norm (head removed)");
  return *norm_;
}

nn::Linear& Transformer::output() {
  LOOM_REQUIRE(output_ != nullptr, "this Transformer has no output head (removed)");
  return *output_;
}

void Transformer::remove_embedding() {
  LOOM_REQUIRE(tok_embeddings_ != nullptr, "tok_embeddings already removed");
  remove_module("tok_embeddings");
  tok_embeddings_.reset();
}

void Transformer::remove_head() {
  LOOM_REQUIRE(output_ != nullptr, "the head is already removed");
  remove_module("norm");
  remove_module("output");
  norm_.reset();
  output_.reset();
}

torch::Tensor Transformer::embed(const torch::Tensor& tokens) {
  return tok_embeddings().forward(tokens);
}

torch::Tensor Transformer::run_layers(torch::Tensor hidden, const nn::TokenLayout& layout) {
  const torch::Tensor& cache = rope_cache_->tensor;
  for (const auto& [name, layer] : layers_->named_children()) {
    // A profiler range per block (profiling/profiler.h); the name is built only while recording.
    RECORD_USER_SCOPE(c10::str("loom::block_forward layers.", name));
    hidden = static_cast<TransformerBlock&>(*layer).forward(hidden, cache, layout);
  }
  return hidden;
}

torch::Tensor Transformer::head(const torch::Tensor& hidden) {
  return output().forward(norm().forward(hidden));
}

torch::Tensor Transformer::forward(const torch::Tensor& tokens) {
  LOOM_REQUIRE(tokens.dim() == 2, "Transformer expects tokens [batch, seq], got shape ",
               tokens.sizes());
  LOOM_REQUIRE(tokens.size(1) <= args_.max_seq_len, "sequence length ", tokens.size(1),
               " exceeds max_seq_len ", args_.max_seq_len, "; build the model with a larger one");
  return call_with_hooks(tokens, [this](const torch::Tensor& in) {
    return head(run_layers(embed(in)));
  });
}

torch::Tensor Transformer::loss_from_normed(const torch::Tensor& hidden,
                                            const torch::Tensor& labels) {
  if (head_loss_) return head_loss_(hidden, *output_, labels);
  if (output_->has_forward_hooks() || output_->has_bias()) {
    // The head is wrapped (e.g. by a parallel style): keep its forward, take the plain loss.
    const torch::Tensor logits = output_->forward(hidden).to(torch::kFloat32);
    return torch::nn::functional::cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1));
  }
  return nn::fused_linear_cross_entropy(hidden.flatten(0, 1), output_->weight(),
                                        labels.flatten(0, 1));
}

torch::Tensor Transformer::forward_loss(const torch::Tensor& tokens, const torch::Tensor& labels,
                                       const nn::TokenLayout& layout) {
  LOOM_REQUIRE(has_embedding() && has_head(), "forward_loss needs the whole model; a part without "
               "its embedding or head runs forward_part");
  LOOM_REQUIRE(tokens.dim() == 2, "Transformer expects tokens [batch, seq], got shape ",
               tokens.sizes());
  LOOM_REQUIRE(labels.sizes() == tokens.sizes(), "labels of shape ", labels.sizes(),
               " do not match tokens of shape ", tokens.sizes());
  LOOM_REQUIRE(tokens.size(1) <= args_.max_seq_len, "sequence length ", tokens.size(1),
               " exceeds max_seq_len ", args_.max_seq_len, "; build the model with a larger one");
  return call_with_hooks(tokens, [&](const torch::Tensor& in) {
    return loss_from_normed(norm_->forward(run_layers(embed(in), layout)), labels);
  });
}

torch::Tensor Transformer::forward_part(const torch::Tensor& input, const torch::Tensor& labels,
                                        const nn::TokenLayout& layout) {
  if (has_embedding() && has_head()) return forward_loss(input, labels, layout);
  const int64_t expected_dim = has_embedding() ? 2 : 3;
  LOOM_REQUIRE(input.dim() == expected_dim, "this part of the Transformer expects ",
               has_embedding() ? "tokens [batch, seq]" : "hidden states [batch, seq, dim]",
               ", got shape ", input.sizes());
  LOOM_REQUIRE(input.size(1) <= args_.max_seq_len, "sequence length ", input.size(1),
               " exceeds max_seq_len ", args_.max_seq_len, "; build the model with a larger one");
  if (has_head()) {
    // The hidden states may hold a slice of each row's sequence (sequence parallelism splits it;
    // the head gathers it back before the loss), so their length need only divide the labels'.
    LOOM_REQUIRE(labels.dim() == 2 && labels.size(0) == input.size(0) && input.size(1) > 0 &&
                     labels.size(1) % input.size(1) == 0,
                 "labels of shape ", labels.sizes(), " do not match hidden states of shape ",
                 input.sizes());
  }
  return call_with_hooks(input, [&](const torch::Tensor& in) {
    torch::Tensor hidden = run_layers(has_embedding() ? embed(in) : in, layout);
    return has_head() ? loss_from_normed(norm_->forward(hidden), labels) : hidden;
  });
}

void Transformer::init_weights(uint64_t seed) {
  for (const auto& p : named_parameters()) {
    nn::init_parameter(parameter_init(args_, p.name), p.name, seed, p.slot->tensor);
  }
  reset_buffers();
}

nn::ParameterInit parameter_init(const ModelArgs& args, const std::string& name) {
  constexpr double kStd = 0.02;
  auto ends_with = [&](std::string_view suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (name == "tok_embeddings.weight") return nn::ParameterInit::normal(1.0);
  if (name == "norm.weight" || ends_with(".attention_norm.weight") ||
      ends_with(".ffn_norm.weight")) {
    return nn::ParameterInit::ones();
  }
  if (name == "output.weight") {
    const double std = 1.0 / std::sqrt(static_cast<double>(args.dim));
    return nn::ParameterInit::truncated_normal(std, -3 * std, 3 * std);
  }
  // layers.<id>.<...>
  const std::string prefix = "layers.";
  LOOM_REQUIRE(name.rfind(prefix, 0) == 0, "no Llama 3 initializer for parameter '", name, "'");
  const size_t dot = name.find('.', prefix.size());
  const std::string id_text = name.substr(prefix.size(), dot - prefix.size());
  LOOM_REQUIRE(dot != std::string::npos && !id_text.empty() &&
                   id_text.find_first_not_of("0123456789") == std::string::npos,
               "no Llama 3 initializer for parameter '", name, "'");
  const int64_t layer_id = std::stoll(id_text);
  const double depth_std =
      args.depth_init ? kStd / std::sqrt(2.0 * static_cast<double>(layer_id + 1))
                      : kStd / std::sqrt(2.0 * static_cast<double>(args.n_layers));
  if (ends_with(".attention.wq.weight") || ends_with(".attention.wk.weight") ||
      ends_with(".attention.wv.weight") || ends_with(".feed_forward.w1.weight")) {
    return nn::ParameterInit::truncated_normal(kStd, -2.0, 2.0);
  }
  if (ends_with(".attention.wo.weight") || ends_with(".feed_forward.w2.weight") ||
      ends_with(".feed_forward.w3.weight")) {
    return nn::ParameterInit::truncated_normal(depth_std, -2.0, 2.0);
  }
  fail("no Llama 3 initializer for parameter '", name, "'");
}

ParameterCounts count_parameters(Transformer& model) {
  ParameterCounts c;
  for (const auto& p : model.named_parameters()) {
    c.total += p.tensor().numel();
    if (p.name == "tok_embeddings.weight") c.embedding += p.tensor().numel();
  }
  c.non_embedding = c.total - c.embedding;
  return c;
}

ParameterCounts count_parameters(const ModelArgs& a) {
  const int64_t hd = a.head_dim();
  const int64_t attention = a.dim * a.n_heads * hd * 2 + a.dim * a.n_kv_heads * hd * 2;
  const int64_t ffn = 3 * a.dim * a.ffn_hidden_dim();
  const int64_t per_layer = attention + ffn + 2 * a.dim;
  ParameterCounts c;
  c.embedding = a.vocab_size * a.dim;
  c.total = c.embedding + a.n_layers * per_layer + a.dim + a.vocab_size * a.dim;
  c.non_embedding = c.total - c.embedding;
  return c;
}

double flops_per_token(const ModelArgs& args, int64_t non_embedding_params, int64_t seq_len) {
  return 6.0 * static_cast<double>(non_embedding_params) +
         12.0 * static_cast<double>(args.n_layers) * static_cast<double>(args.n_heads) *
             static_cast<double>(args.head_dim()) * static_cast<double>(seq_len);
}

}  // namespace loom::llama3
