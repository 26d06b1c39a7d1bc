// Autoregressive generation from any decoder (models/common/decoder.h) with a key/value cache (`loom generate`).
//
// The cache is installed from outside the model, like context parallelism's ring attention: each
// attention layer's core (nn::Attention::set_attend) is replaced by one that appends the new keys
// and values to its layer's cache and lets the new queries attend to everything cached so far.
// The model runs its ordinary embed -> run_layers -> head path with the new tokens' positions
// (nn::TokenLayout::positions, which RoPE reads), so the prompt is one forward over all of its
// tokens (prefill) and each further token one forward of length 1 (decode). A layer's attention
// features (nn::AttendFeatures: GPT-OSS's sinks and sliding window) apply to the cached keys by
// position; the cache keeps every position, also on sliding-window layers.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "loom/models/common/decoder.h"

namespace loom::models {

struct SamplingOptions {
  int64_t max_new_tokens = 64;
  // 0: greedy (the most likely token every time); else the logits are divided by it.
  double temperature = 0.8;
  int64_t top_k = 0;       // keep the k most likely tokens; 0 = all
  double top_p = 1.0;      // keep the smallest set whose probability reaches p; 1 = all
  uint64_t seed = 0;       // the sampling stream: the same seed gives the same tokens
  int64_t stop_id = -1;    // stop after this token (the tokenizer's EOS); -1 = never

  // A one-line loom::UsageError naming the `loom generate` option that is out of range (NaN
  // included) and its valid range; called by the CLI before anything is loaded.
  void validate() const;
};

// Checks that a prompt of `prompt_tokens` plus `max_new_tokens` fits a model of `max_seq_len`
// positions, without overflow for any int64 input; a one-line loom::UsageError naming the numbers
// and what to lower otherwise. Callers run it before building or allocating anything.
void check_generation_fits(int64_t prompt_tokens, int64_t max_new_tokens, int64_t max_seq_len);

// Bytes of the key/value cache Generator (batch 1) or BatchGenerator (`batch` rows) allocates for
// `capacity` tokens (keys and values of every layer) in `dtype`.
int64_t kv_cache_bytes(const DecoderArgs& args, int64_t capacity, c10::ScalarType dtype, int64_t batch = 1);

// The next token from logits [V] (float32 on any device).
int64_t sample_token(const torch::Tensor& logits, const SamplingOptions& options, at::Generator& generator);

class Generator {
 public:
  // Installs the cache on every layer of `model` (batch 1, up to `capacity` tokens: prompt plus
  // new ones, at most the model's max_seq_len) and removes it again on destruction. The cache is
  // allocated here, before any token is produced, so running out of memory is one error naming
  // the cache's size (and `memory_hint`: what the caller's user can lower), not a failure after
  // the first output.
  Generator(Decoder& model, int64_t capacity, const std::string& memory_hint);
  Generator(Decoder& model, int64_t capacity);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // The prompt's continuation (new tokens only); `on_token` sees each as it is chosen.
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, const SamplingOptions& options,
                                const std::function<void(int64_t)>& on_token = nullptr);

  // Logits [V] (float32) of the token after `tokens`, which continue what is cached.
  torch::Tensor forward(const std::vector<int64_t>& tokens);

  int64_t cached() const;
  // The positions layer `layer`'s cache holds: every one seen, or on a sliding-window layer of
  // window w at most the last w - 1 (what any later query can still see besides its own).
  int64_t held_positions(int64_t layer) const;

 private:
  struct LayerCache;
  Decoder& model_;
  int64_t capacity_;
  std::vector<std::shared_ptr<LayerCache>> caches_;
};

// Many sequences decoded together (GRPO's rollouts, issue 51): one key/value cache of `batch`
// rows, each row its own prompt (lengths may differ) and continuation, one forward per step for
// every row still running.
//
// Rows are right-aligned: a prompt shorter than the longest starts `offset` = longest - its length
// positions later, and its cache slots before that are padding no real token attends to (the
// mask's documents: padding is document 0, the row's tokens document 1). Every row then writes its
// next token at the same position, so one forward serves all rows. RoPE makes attention depend only
// on the distance between a query and a key, so a row's logits equal those of the row decoded alone
// from position 0 within float rounding (the tests compare them). Every layer keeps every position
// (a sliding-window layer masks by the window instead of dropping keys, unlike Generator).
class BatchGenerator {
 public:
  // Installs the cache of `batch` rows and `capacity` positions (the longest prompt plus the new
  // tokens, at most max_seq_len) on every layer of `model`, allocated here (an out-of-memory is one
  // error naming the cache's size and `memory_hint`); removes it on destruction.
  BatchGenerator(Decoder& model, int64_t batch, int64_t capacity, const std::string& memory_hint);
  ~BatchGenerator();
  BatchGenerator(const BatchGenerator&) = delete;
  BatchGenerator& operator=(const BatchGenerator&) = delete;

  // One prompt per row (batch of them, none empty, the longest at most capacity): logits [batch,
  // V] (float32) of each row's next token. Once, on an empty cache.
  torch::Tensor prefill(const std::vector<std::vector<int64_t>>& prompts);
  // One token per current row (in row order): logits [rows, V] (float32) of the token after it.
  torch::Tensor decode(const std::vector<int64_t>& tokens);
  // Keeps only the current rows `rows` (ascending indices into the current rows): rows that have
  // finished stop costing compute and cache reads.
  void keep_rows(const std::vector<int64_t>& rows);
  int64_t rows() const { return rows_; }

 private:
  struct State;
  torch::Tensor run(const torch::Tensor& ids);
  Decoder& model_;
  int64_t capacity_;
  int64_t rows_;
  std::shared_ptr<State> state_;
};

}  // namespace loom::models
