#include "loom/rl/rollout.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "loom/core/error.h"

namespace loom::rl {

void init_adapters(models::Decoder& model) {
  torch::NoGradGuard no_grad;
  for (const auto& p : model.named_parameters()) {
    const std::string& n = p.name;
    const auto ends = [&](const char* suffix) {
      const std::string s(suffix);
      return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0;
    };
    if (ends(".lora.a")) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(p.slot->tensor.size(1)));
      p.slot->tensor.uniform_(-bound, bound);
    } else if (ends(".lora.b")) {
      p.slot->tensor.zero_();
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
