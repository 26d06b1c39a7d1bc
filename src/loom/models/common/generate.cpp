#include "loom/models/common/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "loom/core/error.h"
#include "loom/core/memory.h"

namespace loom::models {

void SamplingOptions::validate() const {
  // Written so that NaN fails every check (each comparison with NaN is false).
  LOOM_REQUIRE_USAGE(max_new_tokens >= 1, "--max-new-tokens must be at least 1, got ", max_new_tokens);
  LOOM_REQUIRE_USAGE(temperature >= 0 && std::isfinite(temperature), "--temperature must be a finite number >= 0 ",
                     "(0 = greedy), got ", temperature);
  LOOM_REQUIRE_USAGE(top_k >= 0, "--top-k must be >= 0 (0 = every token), got ", top_k);
  LOOM_REQUIRE_USAGE(top_p > 0 && top_p <= 1, "--top-p must be in (0, 1] (1 = every token), got ", top_p);
}

void check_generation_fits(int64_t prompt_tokens, int64_t max_new_tokens, int64_t max_seq_len) {
  LOOM_REQUIRE_USAGE(prompt_tokens <= max_seq_len, "the prompt has ", prompt_tokens,
                     " tokens but the model's maximum sequence length is ", max_seq_len,
                     "; shorten the prompt to at most ", max_seq_len - 1, " tokens to leave room for new ones");
  // Compared as room left, never as a sum, so --max-new-tokens near INT64_MAX cannot overflow.
  const int64_t room = max_seq_len - prompt_tokens;
  LOOM_REQUIRE_USAGE(max_new_tokens <= room, "the prompt (", prompt_tokens, " tokens) plus --max-new-tokens ",
                     max_new_tokens, " exceed the model's maximum sequence length of ", max_seq_len,
                     room > 0 ? c10::str("; lower --max-new-tokens to at most ", room)
                              : std::string("; shorten the prompt to leave room for new tokens"));
}

namespace {
// Both caches' attention core once the keys are gathered: q [B, t, H, D] against keys and values
// [B, KV, Tk, D] under `mask` or `causal`, with GPT-OSS's sinks where the layer has them;
// [B, t, H x Dv].
torch::Tensor attend_cached(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                            const std::optional<torch::Tensor>& mask, bool causal, const nn::AttendFeatures& features) {
  const int64_t t = q.size(1), heads = q.size(2), v_dim = values.size(3);
  const torch::Tensor out =
      features.sinks.defined()
          ? nn::sink_attention(q.transpose(1, 2), keys, values, mask, causal, features.sinks)
          : at::scaled_dot_product_attention(q.transpose(1, 2), keys, values, mask, 0.0, causal, std::nullopt,
                                             heads != keys.size(1));
  return out.transpose(1, 2).reshape({q.size(0), t, heads * v_dim});
}
}  // namespace

int64_t kv_cache_bytes(const DecoderArgs& args, int64_t capacity, c10::ScalarType dtype, int64_t batch) {
  const int64_t per_token = args.n_layers * args.attention_kv_heads() * (args.qk_head_dim() + args.v_head_dim()) *
                            static_cast<int64_t>(c10::elementSize(dtype));
  return per_token * capacity * batch;
}

namespace {
// The one place that says a layer's cache shape: keys [batch, heads, slots, qk head dim] and
// values [batch, heads, slots, v head dim], `heads` being the KV heads the layer computes on this
// rank (Generator and BatchGenerator both allocate here).
std::pair<torch::Tensor, torch::Tensor> allocate_layer_cache(const DecoderArgs& args, int64_t heads, int64_t batch,
                                                             int64_t slots, const torch::TensorOptions& options) {
  return {torch::empty({batch, heads, slots, args.qk_head_dim()}, options),
          torch::empty({batch, heads, slots, args.v_head_dim()}, options)};
}

// The key/value heads `block`'s attention computes on this rank: the model's, or under tensor
// parallelism the share of them its wk holds (the slot's layout records the split; FSDP keeps it).
int64_t held_kv_heads(DecoderBlock& block, const DecoderArgs& args) {
  auto* attention = dynamic_cast<nn::Attention*>(&block.attention());
  if (attention == nullptr) return args.attention_kv_heads();
  const nn::ParameterSlot& slot = attention->wk().parameter_slot("weight");
  if (!slot.layout) return args.attention_kv_heads();
  return args.attention_kv_heads() * slot.layout->local_box().sizes[0] / slot.layout->global_shape[0];
}
}  // namespace

// A layer's keys and values. A full-attention layer keeps every position ([1, KV, capacity, D]);
// a sliding-window layer of window w keeps only the last w - 1 (the most any later query sees
// besides its own): its cache does not grow with the generation (GPT-OSS's 128-token windows).
struct Generator::LayerCache {
  torch::Tensor k, v;
  int64_t window = 0;  // > 0: the layer's sliding window
  int64_t length = 0;  // positions seen
  int64_t kept = 0;    // positions held: [length - kept, length)
};

Generator::Generator(Decoder& model, int64_t capacity)
    : Generator(model, capacity, "lower --max-new-tokens or shorten the prompt") {}

Generator::Generator(Decoder& model, int64_t capacity, const std::string& memory_hint)
    : model_(model), capacity_(capacity) {
  LOOM_REQUIRE_USAGE(capacity >= 1 && capacity <= model.decoder_args().max_seq_len, "generation needs ", capacity,
                     " positions but the model's RoPE table has ", model.decoder_args().max_seq_len,
                     "; use a shorter prompt or fewer new tokens");
  const DecoderArgs& args = model.decoder_args();
  const torch::Tensor& rope = model.rope_cache();
  // The cache holds what attention's keys and values are computed in: the model's dtype.
  const auto options = model.tok_embeddings().weight().options();
  const int64_t layers = static_cast<int64_t>(model.layers().named_children().size());
  std::vector<int64_t> kv_heads;
  int64_t held_heads = 0;
  for (const auto& [id, layer] : model.layers().named_children()) {
    kv_heads.push_back(held_kv_heads(static_cast<DecoderBlock&>(*layer), args));
    held_heads += kv_heads.back();
  }
  memory::with_allocation_context(
      [&] {
        for (const auto& [id, layer] : model.layers().named_children()) {
          const int64_t heads = kv_heads[caches_.size()];
          auto cache = std::make_shared<LayerCache>();
          cache->window = static_cast<DecoderBlock&>(*layer).attention().sliding_window();
          const int64_t slots = cache->window > 0 ? std::max<int64_t>(1, std::min(capacity, cache->window - 1)) : capacity;
          std::tie(cache->k, cache->v) = allocate_layer_cache(args, heads, 1, slots, options);
          caches_.push_back(std::move(cache));
        }
      },
      c10::str("the key/value cache for ", capacity, " tokens (", layers, " layers)"),
      kv_cache_bytes(args, capacity, options.dtype().toScalarType()) * held_heads /
          std::max<int64_t>(1, layers * args.attention_kv_heads()),
      rope.device(), memory_hint);
  size_t next = 0;
  for (const auto& [id, layer] : model.layers().named_children()) {
    auto cache = caches_[next++];
    const int64_t cap = capacity;
    static_cast<DecoderBlock&>(*layer).attention().set_attend(
        [cache, cap](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const nn::TokenLayout&,
                     const nn::AttendFeatures& features) {
          // q [1, T, H, D], k [1, T, KV, D], v [1, T, KV, Dv], already rotated at their positions.
          const int64_t t = q.size(1);
          const int64_t start = cache->length, end = start + t;
          LOOM_REQUIRE(end <= cap, "key/value cache full: ", end, " > ", cap);
          LOOM_REQUIRE(k.size(2) == cache->k.size(1), "key/value cache of ", cache->k.size(1),
                       " heads for a layer computing ", k.size(2));
          const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(q.device());
          const int64_t window = features.sliding_window;
          std::optional<torch::Tensor> mask;
          bool causal = false;
          torch::Tensor keys, values;
          if (cache->window > 0) {
            // The held positions [start - kept, start) and the new ones, masked by the window; then
            // only the last window - 1 of them are kept.
            const int64_t past = cache->kept;
            keys = torch::cat({cache->k.narrow(2, 0, past), k.transpose(1, 2)}, 2);
            values = torch::cat({cache->v.narrow(2, 0, past), v.transpose(1, 2)}, 2);
            mask = nn::attention_mask(torch::arange(start, end, opts), torch::arange(start - past, end, opts), window);
            const int64_t keep = std::min(cache->k.size(2), std::min(cache->window - 1, past + t));
            cache->k.narrow(2, 0, keep).copy_(keys.narrow(2, past + t - keep, keep));
            cache->v.narrow(2, 0, keep).copy_(values.narrow(2, past + t - keep, keep));
            cache->kept = keep;
            cache->length = end;
          } else {
            cache->k.narrow(2, start, t).copy_(k.transpose(1, 2));
            cache->v.narrow(2, start, t).copy_(v.transpose(1, 2));
            cache->length = end;
            cache->kept = end;
            keys = cache->k.narrow(2, 0, end), values = cache->v.narrow(2, 0, end);
            // New query i sits at position start + i and sees keys 0 .. start + i. A single query
            // sees everything; a prompt from an empty cache is plain causal.
            if (t > 1 && start > 0) {
              mask = nn::attention_mask(torch::arange(start, end, opts), torch::arange(end, opts), window);
            } else if (t > 1) {
              causal = true;
            }
          }
          return attend_cached(q, keys, values, mask, causal, features);
        });
  }
}

Generator::~Generator() {
  for (const auto& [id, layer] : model_.layers().named_children()) {
    static_cast<DecoderBlock&>(*layer).attention().set_attend(nullptr);
  }
}

int64_t Generator::cached() const { return caches_.empty() ? 0 : caches_.front()->length; }

int64_t Generator::held_positions(int64_t layer) const {
  LOOM_REQUIRE(layer >= 0 && layer < static_cast<int64_t>(caches_.size()), "no layer ", layer, " in the cache");
  return caches_[static_cast<size_t>(layer)]->kept;
}

torch::Tensor Generator::forward(const std::vector<int64_t>& tokens) {
  LOOM_REQUIRE(!tokens.empty(), "Generator::forward needs tokens");
  const int64_t start = cached(), t = static_cast<int64_t>(tokens.size());
  const c10::Device device = model_.rope_cache().device();
  const torch::Tensor ids = torch::tensor(tokens, torch::kInt64).unsqueeze(0).to(device);
  nn::TokenLayout layout;
  layout.positions = torch::arange(start, start + t, torch::TensorOptions().dtype(torch::kInt64).device(device));
  // Between the model's own hooks, as its forward runs (FSDP's root gathers the embedding there).
  // Only the last position's logits are needed.
  return model_
      .run_between_hooks(ids,
                         [&](const torch::Tensor& in) {
                           return model_.head(model_.run_layers(model_.embed(in), layout).narrow(1, t - 1, 1));
                         })
      .reshape({-1})
      .to(torch::kFloat32);
}

int64_t sample_token(const torch::Tensor& logits, const SamplingOptions& o, at::Generator& generator) {
  if (o.temperature <= 0.0) return logits.argmax().item<int64_t>();
  torch::Tensor scores = (logits / o.temperature).to(torch::kCPU, torch::kFloat32);
  const int64_t vocab = scores.numel();
  if (o.top_k > 0 && o.top_k < vocab) {
    const torch::Tensor kth = std::get<0>(scores.topk(o.top_k)).min();
    scores = scores.masked_fill(scores < kth, -std::numeric_limits<float>::infinity());
  }
  if (o.top_p < 1.0) {
    auto [sorted, order] = scores.sort(/*dim=*/0, /*descending=*/true);
    const torch::Tensor cumulative = sorted.softmax(0).cumsum(0);
    // Drop a token when the tokens before it already reach top_p (the first always stays).
    const torch::Tensor drop = (cumulative - sorted.softmax(0)) >= o.top_p;
    scores = scores.index_put({order.masked_select(drop)}, torch::tensor(-std::numeric_limits<float>::infinity()));
  }
  return torch::multinomial(scores.softmax(0), 1, /*replacement=*/false, generator).item<int64_t>();
}

std::vector<int64_t> Generator::generate(const std::vector<int64_t>& prompt, const SamplingOptions& o,
                                         const std::function<void(int64_t)>& on_token) {
  LOOM_REQUIRE_USAGE(!prompt.empty(), "generation needs a prompt of at least one token");
  o.validate();
  // Room left, never a sum: max_new_tokens near INT64_MAX cannot overflow.
  const int64_t room = capacity_ - cached() - static_cast<int64_t>(prompt.size());
  LOOM_REQUIRE_USAGE(o.max_new_tokens <= room, "prompt (", prompt.size(), " tokens) plus ", o.max_new_tokens,
                     " new tokens exceed the ", capacity_, " positions of this generator (", cached(),
                     " cached); build it with a larger capacity or ask for fewer tokens");
  torch::InferenceMode inference;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<int64_t> out;
  torch::Tensor logits = forward(prompt);
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    const int64_t next = sample_token(logits, o, generator);
    out.push_back(next);
    if (on_token) on_token(next);
    if (next == o.stop_id || i + 1 == o.max_new_tokens) break;
    logits = forward({next});
  }
  return out;
}

// The cache of every layer, shared by the installed attention cores: keys and values [rows, KV,
// capacity, D] at virtual positions 0..length-1, and each row's document of every position (0:
// padding before the row's prompt, 1: the row's tokens).
struct BatchGenerator::State {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> kv;
  torch::Tensor documents;  // [rows, capacity] int64
  int64_t length = 0;
};

BatchGenerator::BatchGenerator(Decoder& model, int64_t batch, int64_t capacity, const std::string& memory_hint)
    : model_(model), capacity_(capacity), rows_(batch), state_(std::make_shared<State>()) {
  LOOM_REQUIRE(batch >= 1, "BatchGenerator needs at least one row, got ", batch);
  LOOM_REQUIRE_USAGE(capacity >= 1 && capacity <= model.decoder_args().max_seq_len, "generation needs ", capacity,
                     " positions but the model's RoPE table has ", model.decoder_args().max_seq_len,
                     "; use shorter prompts or fewer new tokens");
  const DecoderArgs& args = model.decoder_args();
  const auto options = model.tok_embeddings().weight().options();
  const int64_t layers = static_cast<int64_t>(model.layers().named_children().size());
  memory::with_allocation_context(
      [&] {
        for (const auto& [id, layer] : model.layers().named_children()) {
          state_->kv.push_back(allocate_layer_cache(
              args, held_kv_heads(static_cast<DecoderBlock&>(*layer), args), batch, capacity, options));
        }
      },
      c10::str("the key/value cache for ", batch, " rows of ", capacity, " tokens (", layers, " layers)"),
      kv_cache_bytes(args, capacity, options.dtype().toScalarType(), batch), model.rope_cache().device(),
      memory_hint);
  size_t next = 0;
  for (const auto& [id, layer] : model.layers().named_children()) {
    const size_t index = next++;
    std::shared_ptr<State> state = state_;
    static_cast<DecoderBlock&>(*layer).attention().set_attend(
        [state, index](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const nn::TokenLayout&,
                       const nn::AttendFeatures& features) {
          // q [rows, T, H, D], k [rows, T, KV, D], v [rows, T, KV, Dv], rotated at positions
          // length .. length + T - 1 (every row alike).
          const int64_t t = q.size(1);
          const int64_t start = state->length, end = start + t;
          auto& [keys_cache, values_cache] = state->kv[index];
          LOOM_REQUIRE(end <= keys_cache.size(2), "key/value cache full: ", end, " > ", keys_cache.size(2));
          keys_cache.narrow(2, start, t).copy_(k.transpose(1, 2));
          values_cache.narrow(2, start, t).copy_(v.transpose(1, 2));
          const torch::Tensor keys = keys_cache.narrow(2, 0, end), values = values_cache.narrow(2, 0, end);
          const auto positions = torch::TensorOptions().dtype(torch::kInt64).device(q.device());
          const torch::Tensor documents = state->documents.narrow(1, 0, end);
          // Causal (and windowed) by position, and only within the query's document: a real token
          // never sees its row's padding; a padding query sees earlier padding (so no row is empty).
          const torch::Tensor mask =
              nn::attention_mask(torch::arange(start, end, positions), torch::arange(end, positions),
                                 features.sliding_window, documents.narrow(1, start, t), documents);
          return attend_cached(q, keys, values, mask, false, features);
        });
  }
}

BatchGenerator::~BatchGenerator() {
  for (const auto& [id, layer] : model_.layers().named_children()) {
    static_cast<DecoderBlock&>(*layer).attention().set_attend(nullptr);
  }
}

torch::Tensor BatchGenerator::run(const torch::Tensor& ids) {
  const int64_t start = state_->length, t = ids.size(1);
  const c10::Device device = model_.rope_cache().device();
  nn::TokenLayout layout;
  layout.positions = torch::arange(start, start + t, torch::TensorOptions().dtype(torch::kInt64).device(device));
  const torch::Tensor hidden = model_.run_layers(model_.embed(ids.to(device)), layout);
  state_->length = start + t;
  return model_.head(hidden.narrow(1, t - 1, 1)).squeeze(1).to(torch::kFloat32);
}

torch::Tensor BatchGenerator::prefill(const std::vector<std::vector<int64_t>>& prompts) {
  LOOM_REQUIRE(state_->length == 0, "BatchGenerator::prefill runs once, on an empty cache");
  LOOM_REQUIRE(static_cast<int64_t>(prompts.size()) == rows_, "BatchGenerator::prefill: ", prompts.size(),
               " prompts for ", rows_, " rows");
  int64_t longest = 0;
  for (const auto& p : prompts) {
    LOOM_REQUIRE_USAGE(!p.empty(), "generation needs a prompt of at least one token");
    longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  }
  LOOM_REQUIRE_USAGE(longest <= capacity_, "a prompt of ", longest, " tokens exceeds the ", capacity_,
                     " positions of this generator");
  torch::Tensor ids = torch::zeros({rows_, longest}, torch::kInt64);
  torch::Tensor documents = torch::ones({rows_, capacity_}, torch::kInt64);
  auto id = ids.accessor<int64_t, 2>();
  auto doc = documents.accessor<int64_t, 2>();
  for (int64_t r = 0; r < rows_; ++r) {
    const auto& p = prompts[static_cast<size_t>(r)];
    const int64_t offset = longest - static_cast<int64_t>(p.size());
    for (int64_t j = 0; j < offset; ++j) doc[r][j] = 0;
    for (size_t j = 0; j < p.size(); ++j) id[r][offset + static_cast<int64_t>(j)] = p[j];
  }
  state_->documents = documents.to(model_.rope_cache().device());
  return run(ids);
}

torch::Tensor BatchGenerator::decode(const std::vector<int64_t>& tokens) {
  LOOM_REQUIRE(state_->length > 0, "BatchGenerator::decode before prefill");
  LOOM_REQUIRE(static_cast<int64_t>(tokens.size()) == rows_, "BatchGenerator::decode: ", tokens.size(),
               " tokens for ", rows_, " rows");
  LOOM_REQUIRE(state_->length < capacity_, "BatchGenerator: all ", capacity_, " positions are used");
  return run(torch::tensor(tokens, torch::kInt64).unsqueeze(1));
}

void BatchGenerator::keep_rows(const std::vector<int64_t>& rows) {
  LOOM_REQUIRE(!rows.empty(), "BatchGenerator::keep_rows needs at least one row");
  if (static_cast<int64_t>(rows.size()) == rows_) return;
  const torch::Tensor index = torch::tensor(rows, torch::kInt64).to(model_.rope_cache().device());
  for (auto& [k, v] : state_->kv) {
    k = k.index_select(0, index);
    v = v.index_select(0, index);
  }
  state_->documents = state_->documents.index_select(0, index);
  rows_ = static_cast<int64_t>(rows.size());
}

}  // namespace loom::models
