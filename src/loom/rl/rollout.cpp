#include "loom/rl/rollout.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "loom/core/error.h"
#include "loom/lora/lora.h"
#include "loom/nn/init.h"

namespace loom::rl {

void init_adapters(models::Decoder& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for (const auto& p : model.named_parameters()) {
    if (const std::optional<nn::ParameterInit> init = lora::adapter_init(p.name)) {
      nn::init_parameter(*init, p.name, seed, p.slot->tensor);
    }
  }
}

uint64_t completion_seed(uint64_t seed, int64_t step, int64_t index) {
  const auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  return mix(mix(mix(seed) ^ static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(index));
}

Completion sample_completion(models::Decoder& model, const std::vector<int64_t>& prompt,
                             const models::SamplingOptions& options, at::Generator& generator) {
  LOOM_REQUIRE_USAGE(!prompt.empty(), "a prompt needs at least one token");
  torch::InferenceMode inference;
  models::Generator cache(model, static_cast<int64_t>(prompt.size()) + options.max_new_tokens);
  Completion out;
  torch::Tensor logits = cache.forward(prompt);
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    const int64_t next = models::sample_token(logits, options, generator);
    const torch::Tensor logp = torch::log_softmax(logits.to(torch::kFloat32) / options.temperature, 0);
    out.tokens.push_back(next);
    out.logp.push_back(logp[next].item<double>());
    if (next == options.stop_id || i + 1 == options.max_new_tokens) break;
    logits = cache.forward({next});
  }
  return out;
}

std::vector<Completion> sample_completions(models::Decoder& model, const std::vector<std::vector<int64_t>>& prompts,
                                           const models::SamplingOptions& options,
                                           std::vector<at::Generator>& generators, const RowsFn& on_rows) {
  LOOM_REQUIRE(!prompts.empty() && generators.size() == prompts.size(), "sample_completions: ", prompts.size(),
               " prompts for ", generators.size(), " generators");
  torch::InferenceMode inference;
  int64_t longest = 0;
  for (const auto& p : prompts) {
    LOOM_REQUIRE_USAGE(!p.empty(), "a prompt needs at least one token");
    longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  }
  models::BatchGenerator cache(model, static_cast<int64_t>(prompts.size()), longest + options.max_new_tokens,
                               "lower rl.max_new_tokens, rl.prompts_per_step or rl.group_size");
  std::vector<Completion> out(prompts.size());
  std::vector<int64_t> running(prompts.size());  // the cache's rows, as indices into prompts
  for (size_t i = 0; i < running.size(); ++i) running[i] = static_cast<int64_t>(i);
  if (on_rows) on_rows(running);
  torch::Tensor logits = cache.prefill(prompts);
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    // One transfer and one log_softmax for every row; the sampling itself is sample_token's.
    const torch::Tensor scores = logits.to(torch::kCPU, torch::kFloat32);
    const torch::Tensor logp = torch::log_softmax(scores / options.temperature, 1);
    std::vector<int64_t> next_tokens, kept_rows, kept_running;
    for (size_t r = 0; r < running.size(); ++r) {
      const int64_t row = running[r];
      const int64_t next = models::sample_token(scores[static_cast<int64_t>(r)], options, generators[row]);
      Completion& c = out[static_cast<size_t>(row)];
      c.tokens.push_back(next);
      c.logp.push_back(logp[static_cast<int64_t>(r)][next].item<double>());
      if (next != options.stop_id) {
        next_tokens.push_back(next);
        kept_rows.push_back(static_cast<int64_t>(r));
        kept_running.push_back(row);
      }
    }
    if (kept_rows.empty() || step + 1 == options.max_new_tokens) break;
    if (kept_rows.size() != running.size()) {
      cache.keep_rows(kept_rows);
      running = std::move(kept_running);
    }
    if (on_rows) on_rows(running);
    logits = cache.decode(next_tokens);
  }
  return out;
}

Batch make_batch(const std::vector<std::vector<int64_t>>& prompts, const std::vector<Completion>& completions) {
  LOOM_REQUIRE(prompts.size() == completions.size() && !prompts.empty(), "make_batch: ", prompts.size(),
               " prompts for ", completions.size(), " completions");
  const int64_t b = static_cast<int64_t>(prompts.size());
  int64_t t = 0;
  for (int64_t i = 0; i < b; ++i) {
    LOOM_REQUIRE(!completions[i].tokens.empty(), "make_batch: completion ", i, " is empty");
    t = std::max<int64_t>(t, static_cast<int64_t>(prompts[i].size() + completions[i].tokens.size()));
  }
  Batch batch;
  batch.tokens = torch::zeros({b, t}, torch::kInt64);
  batch.mask = torch::zeros({b, t - 1}, torch::kFloat32);
  auto tokens = batch.tokens.accessor<int64_t, 2>();
  auto mask = batch.mask.accessor<float, 2>();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t p = static_cast<int64_t>(prompts[i].size());
    for (int64_t j = 0; j < p; ++j) tokens[i][j] = prompts[i][j];
    for (size_t j = 0; j < completions[i].tokens.size(); ++j) {
      tokens[i][p + static_cast<int64_t>(j)] = completions[i].tokens[j];
      mask[i][p + static_cast<int64_t>(j) - 1] = 1.0f;
    }
  }
  return batch;
}

torch::Tensor token_logprobs(models::Decoder& model, const Batch& batch, double temperature) {
  const c10::Device device = model.rope_cache().device();
  const torch::Tensor tokens = batch.tokens.to(device);
  const int64_t t = tokens.size(1);
  const torch::Tensor logits = model.forward(tokens.narrow(1, 0, t - 1)).to(torch::kFloat32) / temperature;
  const torch::Tensor logp = torch::log_softmax(logits, -1)
                                 .gather(-1, tokens.narrow(1, 1, t - 1).unsqueeze(-1))
                                 .squeeze(-1);
  return logp * batch.mask.to(device);
}

torch::Tensor rollout_logprobs(const std::vector<std::vector<int64_t>>& prompts,
                               const std::vector<Completion>& completions, const Batch& batch) {
  torch::Tensor out = torch::zeros_like(batch.mask);
  auto a = out.accessor<float, 2>();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t p = static_cast<int64_t>(prompts[i].size());
    for (size_t j = 0; j < completions[i].logp.size(); ++j) {
      a[static_cast<int64_t>(i)][p + static_cast<int64_t>(j) - 1] = static_cast<float>(completions[i].logp[j]);
    }
  }
  return out;
}

}  // namespace loom::rl
