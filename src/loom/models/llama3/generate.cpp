#include "loom/models/llama3/generate.h"

#include <algorithm>

#include "loom/core/error.h"

namespace loom::llama3 {

struct Generator::LayerCache {
  torch::Tensor k, v;  // [1, KV, capacity, D], allocated at the first forward
  int64_t length = 0;
};

Generator::Generator(Transformer& model, int64_t capacity) : model_(model), capacity_(capacity) {
  LOOM_REQUIRE_USAGE(capacity >= 1 && capacity <= model.args().max_seq_len, "generation needs ", capacity,
                     " positions but the model's RoPE table has ", model.args().max_seq_len,
                     "; use a shorter prompt or fewer new tokens");
  for (const auto& [id, layer] : model.layers().named_children()) {
    auto cache = std::make_shared<LayerCache>();
    caches_.push_back(cache);
    const int64_t cap = capacity;
    static_cast<TransformerBlock&>(*layer).attention().set_attend(
        [cache, cap](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const nn::TokenLayout&) {
          // q [1, T, H, D], k/v [1, T, KV, D], already rotated at their positions.
          const int64_t t = q.size(1), heads = q.size(2), head_dim = q.size(3);
          if (!cache->k.defined()) {
            cache->k = torch::empty({k.size(0), k.size(2), cap, head_dim}, k.options());
            cache->v = torch::empty_like(cache->k);
          }
          const int64_t start = cache->length, end = start + t;
          LOOM_REQUIRE(end <= cap, "key/value cache full: ", end, " > ", cap);
          cache->k.narrow(2, start, t).copy_(k.transpose(1, 2));
          cache->v.narrow(2, start, t).copy_(v.transpose(1, 2));
          cache->length = end;
          const torch::Tensor keys = cache->k.narrow(2, 0, end), values = cache->v.narrow(2, 0, end);
          // New query i sits at position start + i and sees keys 0 .. start + i. A single query sees
          // everything; a prompt from an empty cache is plain causal.
          std::optional<torch::Tensor> mask;
          bool causal = false;
          if (t > 1 && start == 0) {
            causal = true;
          } else if (t > 1) {
            const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(q.device());
            mask = torch::arange(end, opts).unsqueeze(0) <= (torch::arange(t, opts) + start).unsqueeze(1);
          }
          const torch::Tensor out = at::scaled_dot_product_attention(
              q.transpose(1, 2), keys, values, mask, 0.0, causal, std::nullopt, heads != keys.size(1));
          return out.transpose(1, 2).reshape({q.size(0), t, heads * head_dim});
        });
  }
}

Generator::~Generator() {
  for (const auto& [id, layer] : model_.layers().named_children()) {
    static_cast<TransformerBlock&>(*layer).attention().set_attend(nullptr);
  }
}

int64_t Generator::cached() const { return caches_.empty() ? 0 : caches_.front()->length; }

torch::Tensor Generator::forward(const std::vector<int64_t>& tokens) {
  LOOM_REQUIRE(!tokens.empty(), "Generator::forward needs tokens");
  const int64_t start = cached(), t = static_cast<int64_t>(tokens.size());
  const c10::Device device = model_.rope_cache().device();
  const torch::Tensor ids = torch::tensor(tokens, torch::kInt64).unsqueeze(0).to(device);
  nn::TokenLayout layout;
  layout.positions = torch::arange(start, start + t, torch::TensorOptions().dtype(torch::kInt64).device(device));
  const torch::Tensor hidden = model_.run_layers(model_.embed(ids), layout);
  // Only the last position's logits are needed.
  return model_.head(hidden.narrow(1, t - 1, 1)).reshape({-1}).to(torch::kFloat32);
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
  LOOM_REQUIRE_USAGE(o.temperature >= 0 && o.top_k >= 0 && o.top_p > 0 && o.top_p <= 1,
                     "sampling needs temperature >= 0, top_k >= 0 and top_p in (0, 1]");
  LOOM_REQUIRE_USAGE(cached() + static_cast<int64_t>(prompt.size()) + o.max_new_tokens <= capacity_,
                     "prompt (", prompt.size(), " tokens) plus ", o.max_new_tokens, " new tokens exceed the ",
                     capacity_, " positions of this generator");
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

}  // namespace loom::llama3
