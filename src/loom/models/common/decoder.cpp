#include "loom/models/common/decoder.h"

#include <ATen/record_function.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/nn/fused.h"

namespace loom::models {

void DecoderArgs::validate() const {
  LOOM_REQUIRE_USAGE(dim > 0 && n_layers > 0 && n_heads > 0 && n_kv_heads > 0 && vocab_size > 0,
                     "model args need positive dim, n_layers, n_heads, n_kv_heads and vocab_size (got ",
                     dim, ", ", n_layers, ", ", n_heads, ", ", n_kv_heads, ", ", vocab_size, ")");
  LOOM_REQUIRE_USAGE(n_heads % n_kv_heads == 0, "n_heads (", n_heads, ") must be a multiple of n_kv_heads (",
                     n_kv_heads, ")");
  LOOM_REQUIRE_USAGE(fixed_head_dim.has_value() || dim % n_heads == 0, "dim (", dim,
                     ") must be divisible by n_heads (", n_heads, ")");
  LOOM_REQUIRE_USAGE(head_dim() > 0 && head_dim() % 2 == 0, "head_dim (", head_dim(),
                     ") must be positive and even (RoPE rotates pairs)");
  LOOM_REQUIRE_USAGE(ffn_hidden_dim() > 0, "the FFN hidden size must be positive, got ", ffn_hidden_dim());
  LOOM_REQUIRE_USAGE(max_seq_len > 0, "max_seq_len must be positive, got ", max_seq_len);
  LOOM_REQUIRE_USAGE(norm_eps > 0, "norm_eps must be positive, got ", norm_eps);
}

nn::AttentionOptions DecoderArgs::attention_options(int64_t /*layer_id*/) const {
  nn::AttentionOptions variant;
  variant.head_dim = head_dim();
  if (qk_norm) variant.qk_norm_eps = norm_eps;
  return variant;
}

TransformerBlock::TransformerBlock(int64_t layer_id, const DecoderArgs& args, const torch::TensorOptions& options)
    : DecoderBlock("TransformerBlock", layer_id) {
  const nn::AttentionOptions variant = args.attention_options(layer_id);
  attention_norm_ = register_module("attention_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  attention_ = register_module(
      "attention", std::make_shared<nn::Attention>(args.dim, args.n_heads, args.n_kv_heads, options, variant));
  ffn_norm_ = register_module("ffn_norm", std::make_shared<nn::RMSNorm>(args.dim, args.norm_eps, options));
  feed_forward_ = register_module("feed_forward",
                                  std::make_shared<nn::FeedForward>(args.dim, args.ffn_hidden_dim(), options));
}

torch::Tensor TransformerBlock::forward(const torch::Tensor& x, const torch::Tensor& rope_cache,
                                        const nn::TokenLayout& layout) {
  // The lambda owns its per-call arguments (copies of a few tensor handles): an around-hook may
  // keep it past this call and run it again in backward (activation checkpointing's recompute,
  // ac/activation_checkpoint.h), when the caller's rope_cache and layout references are gone.
  return call_with_hooks(x, [this, rope_cache, layout](const torch::Tensor& in) {
    const torch::Tensor attended = attention_->forward(attention_norm_->forward(in), rope_cache, layout);
    auto [h, normed] = ffn_norm_->add_and_forward(in, attended);
    return h + feed_forward_->forward(normed);
  });
}

Decoder::Decoder(std::string type_name, std::shared_ptr<const DecoderArgs> args, const BlockFactory& make_block,
                 const torch::TensorOptions& options)
    : nn::Module(std::move(type_name)), args_(std::move(args)) {
  LOOM_REQUIRE(args_ != nullptr, "a Decoder needs its args");
  args_->validate();
  const DecoderArgs& a = *args_;
  tok_embeddings_ = register_module("tok_embeddings", std::make_shared<nn::Embedding>(a.vocab_size, a.dim, options));
  layers_ = register_module("layers", std::make_shared<nn::ModuleDict>());
  for (int64_t i = 0; i < a.n_layers; ++i) layers_->add(std::to_string(i), make_block(i, a, options));
  norm_ = register_module("norm", std::make_shared<nn::RMSNorm>(a.dim, a.norm_eps, options));
  if (!a.tie_embeddings) {
    output_ = register_module("output", std::make_shared<nn::Linear>(a.dim, a.vocab_size, options));
  }
  // The RoPE cache stays fp32 whatever the parameter dtype (bf16 angles lose positions).
  const auto cache_options = options.dtype(torch::kFloat32).requires_grad(false);
  rope_cache_ = register_buffer("freqs", torch::empty({2, a.max_seq_len, a.rope_dim()}, cache_options),
                                /*persistent=*/false);
  if (!rope_cache_->tensor.is_meta()) reset_buffers();
}

void Decoder::reset_buffers() {
  torch::Tensor& cache = rope_cache_->tensor;
  LOOM_REQUIRE(!cache.is_meta(), "cannot compute the RoPE cache on the meta device; call to_empty(device) first");
  const DecoderArgs& a = *args_;
  cache = a.rope_cache_values().to(cache.device(), cache.scalar_type());
  for (const auto& [id, block] : layers_->named_children()) {
    if (auto* b = dynamic_cast<DecoderBlock*>(block.get())) b->reset_buffers();
  }
}

nn::Embedding& Decoder::tok_embeddings() {
  LOOM_REQUIRE(tok_embeddings_ != nullptr, "this ", type_name(), " has no tok_embeddings (removed)");
  return *tok_embeddings_;
}

DecoderBlock& Decoder::layer(const std::string& id) { return static_cast<DecoderBlock&>(layers_->submodule(id)); }

nn::RMSNorm& Decoder::norm() {
  LOOM_REQUIRE(norm_ != nullptr, "this ", type_name(), " has no final norm (head removed)");
  return *norm_;
}

nn::Linear& Decoder::output() {
  LOOM_REQUIRE(output_ != nullptr, "this ", type_name(), " has no output head (",
               args_->tie_embeddings ? "tied to tok_embeddings" : "removed", ")");
  return *output_;
}

const torch::Tensor& Decoder::head_weight() {
  return args_->tie_embeddings ? tok_embeddings().weight() : output().weight();
}

void Decoder::remove_embedding() {
  LOOM_REQUIRE(tok_embeddings_ != nullptr, "tok_embeddings already removed");
  LOOM_REQUIRE(!args_->tie_embeddings || !has_head(),
               "a tied decoder's head is its embedding: remove the head before the embedding");
  remove_module("tok_embeddings");
  tok_embeddings_.reset();
}

void Decoder::remove_head() {
  LOOM_REQUIRE(norm_ != nullptr, "the head is already removed");
  remove_module("norm");
  norm_.reset();
  if (output_) {
    remove_module("output");
    output_.reset();
  }
}

torch::Tensor Decoder::embed(const torch::Tensor& tokens) { return tok_embeddings().forward(tokens); }

torch::Tensor Decoder::run_layers(torch::Tensor hidden, const nn::TokenLayout& layout) {
  const torch::Tensor& cache = rope_cache_->tensor;
  for (const auto& [name, layer] : layers_->named_children()) {
    // A profiler range per block (profiling/profiler.h); the name is built only while recording.
    RECORD_USER_SCOPE(c10::str("loom::block_forward layers.", name));
    hidden = static_cast<DecoderBlock&>(*layer).forward(hidden, cache, layout);
  }
  return hidden;
}

torch::Tensor Decoder::head(const torch::Tensor& hidden) {
  const torch::Tensor normed = norm().forward(hidden);
  return output_ ? output_->forward(normed) : torch::nn::functional::linear(normed, tok_embeddings().weight());
}

void Decoder::check_length(int64_t length) const {
  LOOM_REQUIRE(length <= args_->max_seq_len, "sequence length ", length, " exceeds max_seq_len ",
               args_->max_seq_len, "; build the model with a larger one");
}

torch::Tensor Decoder::forward(const torch::Tensor& tokens) {
  LOOM_REQUIRE(tokens.dim() == 2, type_name(), " expects tokens [batch, seq], got shape ", tokens.sizes());
  check_length(tokens.size(1));
  return call_with_hooks(tokens, [this](const torch::Tensor& in) { return head(run_layers(embed(in))); });
}

torch::Tensor Decoder::loss_from_normed(const torch::Tensor& hidden, const torch::Tensor& labels) {
  if (head_loss_) return head_loss_(hidden, head_weight(), labels);
  if (output_ && (output_->has_transforming_hooks() || output_->has_bias())) {
    // The head is wrapped (e.g. by a parallel style): keep its forward, take the plain loss.
    const torch::Tensor logits = output_->forward(hidden).to(torch::kFloat32);
    return torch::nn::functional::cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1));
  }
  if (!output_) return nn::fused_linear_cross_entropy(hidden.flatten(0, 1), head_weight(), labels.flatten(0, 1));
  // The fused loss reads output.weight itself; running it between the head's state-only hooks lets
  // an FSDP group holding the head gather the weight first (read it inside, after them) and hook the
  // backward on the loss.
  return output_->run_between_hooks(hidden, [&](const torch::Tensor& in) {
    return nn::fused_linear_cross_entropy(in.flatten(0, 1), output_->weight(), labels.flatten(0, 1));
  });
}

torch::Tensor Decoder::forward_loss(const torch::Tensor& tokens, const torch::Tensor& labels,
                                    const nn::TokenLayout& layout) {
  LOOM_REQUIRE(has_embedding() && has_head(), "forward_loss needs the whole model; a part without "
               "its embedding or head runs forward_part");
  LOOM_REQUIRE(tokens.dim() == 2, type_name(), " expects tokens [batch, seq], got shape ", tokens.sizes());
  LOOM_REQUIRE(labels.sizes() == tokens.sizes(), "labels of shape ", labels.sizes(),
               " do not match tokens of shape ", tokens.sizes());
  check_length(tokens.size(1));
  return call_with_hooks(tokens, [&](const torch::Tensor& in) {
    return loss_from_normed(norm_->forward(run_layers(embed(in), layout)), labels);
  });
}

torch::Tensor Decoder::forward_part(const torch::Tensor& input, const torch::Tensor& labels,
                                    const nn::TokenLayout& layout) {
  if (has_embedding() && has_head()) return forward_loss(input, labels, layout);
  const int64_t expected_dim = has_embedding() ? 2 : 3;
  LOOM_REQUIRE(input.dim() == expected_dim, "this part of the ", type_name(), " expects ",
               has_embedding() ? "tokens [batch, seq]" : "hidden states [batch, seq, dim]", ", got shape ",
               input.sizes());
  check_length(input.size(1));
  if (has_head()) {
    // The hidden states may hold a slice of each row's sequence (sequence parallelism splits it;
    // the head gathers it back before the loss), so their length need only divide the labels'.
    LOOM_REQUIRE(labels.dim() == 2 && labels.size(0) == input.size(0) && input.size(1) > 0 &&
                     labels.size(1) % input.size(1) == 0,
                 "labels of shape ", labels.sizes(), " do not match hidden states of shape ", input.sizes());
  }
  return call_with_hooks(input, [&](const torch::Tensor& in) {
    torch::Tensor hidden = run_layers(has_embedding() ? embed(in) : in, layout);
    return has_head() ? loss_from_normed(norm_->forward(hidden), labels) : hidden;
  });
}

nn::ParameterInit Decoder::initializer(const std::string& name) const {
  for (const Initializer& init : initializers_) {
    if (auto found = init(name)) return *found;
  }
  return parameter_init(name);
}

void Decoder::init_weights(uint64_t seed) {
  for (const auto& p : named_parameters()) {
    nn::init_parameter(initializer(p.name), p.name, seed, p.slot->tensor);
  }
  reset_buffers();
}

ParameterCounts count_parameters(Decoder& model) {
  ParameterCounts c;
  for (const auto& p : model.named_parameters()) {
    c.total += p.tensor().numel();
    if (p.name == "tok_embeddings.weight") c.embedding += p.tensor().numel();
  }
  c.non_embedding = c.total - c.embedding;
  c.active = c.total;  // (a built model does not say which parameters a token skips)
  return c;
}

torch::Tensor DecoderArgs::rope_cache_values() const {
  return nn::rope_cache(nn::rope_inverse_frequencies(head_dim(), rope_theta, rope_scaling_or_none()), max_seq_len);
}

ParameterCounts count_transformer_parameters(const DecoderArgs& a) {
  const int64_t hd = a.head_dim();
  const int64_t attention = a.dim * a.n_heads * hd * 2 + a.dim * a.n_kv_heads * hd * 2 + (a.qk_norm ? 2 * hd : 0);
  const int64_t ffn = 3 * a.dim * a.ffn_hidden_dim();
  const int64_t per_layer = attention + ffn + 2 * a.dim;
  ParameterCounts c;
  c.embedding = a.vocab_size * a.dim;
  c.total = c.embedding + a.n_layers * per_layer + a.dim + (a.tie_embeddings ? 0 : a.vocab_size * a.dim);
  c.non_embedding = c.total - c.embedding;
  c.active = c.total;
  return c;
}

double flops_per_token(const DecoderArgs& args, int64_t non_embedding_params, int64_t seq_len) {
  // Attention's score and value matmuls: 6 H (d_qk + d_v) T per layer (12 L H d T in all when the
  // widths agree), T the keys a query may see: the sequence, or a sliding window's span.
  double keys = 0;
  for (int64_t layer = 0; layer < args.n_layers; ++layer) {
    const int64_t window = args.attention_options(layer).sliding_window;
    keys += static_cast<double>(window > 0 ? std::min(window, seq_len) : seq_len);
  }
  return 6.0 * static_cast<double>(non_embedding_params) +
         6.0 * static_cast<double>(args.n_heads) * static_cast<double>(args.qk_head_dim() + args.v_head_dim()) * keys;
}

void fail_unknown_flavor(const std::string& family, const std::string& name, const std::vector<std::string>& valid) {
  std::string list;
  for (const auto& n : valid) list += (list.empty() ? "" : ", ") + n;
  fail_usage("unknown ", family, " flavor '", name, "'; valid flavors: ", list);
}

std::optional<std::pair<int64_t, std::string>> split_layer_name(const std::string& name) {
  const std::string prefix = "layers.";
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', prefix.size());
  const std::string id = name.substr(prefix.size(), dot == std::string::npos ? std::string::npos : dot - prefix.size());
  if (dot == std::string::npos || id.empty() || id.size() > 9 ||
      id.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  return std::make_pair(std::stoll(id), name.substr(dot + 1));
}

}  // namespace loom::models
