// Rollouts for GRPO (issue 51): completions sampled with the KV-cache generator, each token's
// log-probability under the rollout policy recorded as it is sampled, and the same log-probabilities
// recomputed by one batched, differentiable forward for the update.
//
// The log-probability of a token is that of the sampling distribution before top-k/top-p:
// log_softmax(logits / temperature) (TRL's convention).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "loom/models/common/decoder.h"
#include "loom/models/common/generate.h"

namespace loom::rl {

// Fills freshly applied LoRA adapters as the Trainer's composition does (lora::adapter_init drawn
// by nn::init_parameter from `seed` and each parameter's name): A kaiming-uniform, B zero (the
// model starts as its base). The same values whatever the layout, so a one-process `loom rl` and
// one under FSDP/TP (parallel_policy.h) start from the same adapters.
void init_adapters(models::Decoder& model, uint64_t seed);

struct Completion {
  std::vector<int64_t> tokens;  // the new tokens (the stop token included when sampled)
  std::vector<double> logp;     // each one's log-probability under the rollout policy
};

// The seed of completion `index` (prompt p's sample g is index p * G + g, counted over the whole
// step's batch, every rank and policy alike) at GRPO step `step` of a job seeded `seed`: each
// completion samples from its own stream, so the tokens do not depend on how completions are
// batched, split over data-parallel ranks or ordered (splitmix64 of the three).
uint64_t completion_seed(uint64_t seed, int64_t step, int64_t index);

// One completion of `prompt` (a fresh cache of prompt + max_new_tokens positions), sampling from
// `generator`'s stream. Runs under InferenceMode.
Completion sample_completion(models::Decoder& model, const std::vector<int64_t>& prompt,
                             const models::SamplingOptions& options, at::Generator& generator);

// Every prompt's completion decoded together (models::BatchGenerator: one cache of
// prompts.size() rows, prompts of any lengths; a row stops at options.stop_id and stops costing
// compute). Row i samples from generators[i] exactly as sample_completion does, so its tokens are
// those of sample_completion with that generator and its log-probabilities equal within float
// rounding. `on_rows`, when set, is told before every forward which rows it computes (indices into
// `prompts`, ascending): per-row adapters (rl/policies.h) follow it. Runs under InferenceMode.
using RowsFn = std::function<void(const std::vector<int64_t>& rows)>;
std::vector<Completion> sample_completions(models::Decoder& model, const std::vector<std::vector<int64_t>>& prompts,
                                           const models::SamplingOptions& options,
                                           std::vector<at::Generator>& generators, const RowsFn& on_rows = nullptr);

struct Batch {
  torch::Tensor tokens;  // [B, T] int64: prompt + completion, right-padded with 0
  torch::Tensor mask;    // [B, T - 1] float: 1 where position t + 1 is a completion token
};
// B = prompts.size() = completions.size(); each row prompt[i] + completions[i].
Batch make_batch(const std::vector<std::vector<int64_t>>& prompts, const std::vector<Completion>& completions);

// logp [B, T - 1] (float32, differentiable through the model): log_softmax(logits[:, t] /
// temperature)[tokens[:, t + 1]], 0 where the mask is 0.
torch::Tensor token_logprobs(models::Decoder& model, const Batch& batch, double temperature);

// The rollout log-probabilities laid out as token_logprobs' [B, T - 1].
torch::Tensor rollout_logprobs(const std::vector<std::vector<int64_t>>& prompts,
                               const std::vector<Completion>& completions, const Batch& batch);

}  // namespace loom::rl
