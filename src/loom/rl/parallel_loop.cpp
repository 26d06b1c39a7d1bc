// The `loom rl` loop under parallelism (issue 51): launched on several ranks, or with a degree of
// [parallelism] above 1, the policy is built by the Trainer's composition (rl/parallel_policy.h)
// and each step splits over the data- and tensor-parallel ranks as that header describes. The
// single-process loop (rl_cli.cpp) keeps what only one process does (batched rollouts, several
// policies, PEFT revisions with resume and rollback); both initialise the adapters per parameter
// name from training.seed, run Loom's [optimizer] with the [lr_scheduler] schedule and the float64
// GRPO loss, so a parallel run equals one process (RlParallel's acceptance test).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/timer.h"
#include "loom/data/tokenizer.h"
#include "loom/lora/lora.h"
#include "loom/rl/adapter_update.h"
#include "loom/rl/grpo.h"
#include "loom/rl/parallel_policy.h"
#include "loom/rl/rewards.h"
#include "loom/rl/rl_cli.h"
#include "loom/rl/rollout.h"

namespace loom::rl {
namespace fs = std::filesystem;

void run_parallel_rl(const train::JobConfig& job, const RlConfig& rl, const data::Tokenizer& tokenizer) {
  LOOM_REQUIRE_USAGE(!rl.resume && rl.rollback.empty(),
                     "rl.resume and rl.rollback continue a PEFT revision of a one-process run; under loom launch or "
                     "parallelism degrees start a fresh run");
  const std::vector<Prompt> prompts =
      read_prompts(rl.prompts, tokenizer, rl.add_bos, rl.max_new_tokens, job.training.seq_len);
  std::unique_ptr<ExternalReward> command;
  if (rl.reward == RewardKind::kCommand) {
    command = std::make_unique<ExternalReward>(rl.reward_command, std::chrono::seconds(rl.reward_timeout_seconds));
  }
  const int64_t vocab = job.model.vocab_size > 0 ? job.model.vocab_size : tokenizer.vocab_size();
  LOOM_REQUIRE_USAGE(vocab >= tokenizer.vocab_size(), "model.vocab_size ", vocab,
                     " is smaller than the tokenizer's vocabulary (", tokenizer.vocab_size(),
                     "); raise it or set 0 to use the tokenizer's");

  // The model as the Trainer builds it (LoRA on the base, then the layout's parallelisms).
  ParallelPolicy policy(job, rl, vocab);
  models::Decoder& model = policy.decoder();
  const bool main_rank = policy.main_rank();
  log::info("rl: LoRA adapters of rank ", job.lora.rank, " (scaling ", lora::LoRAOptions::from(job.lora).scaling(),
            ") on ", job.lora.target_modules, ", the base frozen");
  std::vector<lora::Adapter*> adapters;  // switched off for the reference (the base)
  for (const auto& [path, module] : model.named_modules()) {
    if (auto* adapter = dynamic_cast<lora::Adapter*>(module)) adapters.push_back(adapter);
  }

  const fs::path dump(job.job.dump_folder);
  std::ofstream metrics;
  if (main_rank) {
    fs::create_directories(dump);
    metrics.open(dump / "metrics.jsonl", std::ios::app);
  }
  // Every sampled completion, by its global index, from the rank that sampled it.
  fs::create_directories(dump / "rollouts");
  std::ofstream rollouts(dump / "rollouts" / c10::str("rank", policy.rank(), ".jsonl"), std::ios::app);
  const models::SamplingOptions sampling = rl.sampling(tokenizer.eos_id());
  const GrpoOptions grpo = rl.grpo();
  const auto save = [&](int64_t step) { policy.save_adapters(dump / "adapters" / c10::str("step-", step), step); };

  size_t next_prompt = 0;
  const auto [first_prompt, end_prompt] = policy.prompt_range(rl.prompts_per_step);
  for (int64_t step = 1; step <= job.training.steps; ++step) {
    Timer timer;
    std::vector<std::vector<int64_t>> rows;
    std::vector<Completion> completions;
    std::vector<RewardRequest> requests;
    // This rank's prompts of the step (whole groups); the index of each completion is global.
    for (int64_t p = first_prompt; p < end_prompt; ++p) {
      const Prompt& prompt = prompts[(next_prompt + static_cast<size_t>(p)) % prompts.size()];
      for (int64_t g = 0; g < rl.group_size; ++g) {
        at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(
            completion_seed(static_cast<uint64_t>(job.training.seed), step, p * rl.group_size + g));
        Completion c = policy.sample(prompt.ids, sampling, generator);
        std::vector<int64_t> text_ids = c.tokens;
        if (!text_ids.empty() && text_ids.back() == sampling.stop_id) text_ids.pop_back();
        requests.push_back({prompt.text, tokenizer.decode(text_ids, /*skip_special=*/true), prompt.answer});
        rows.push_back(prompt.ids);
        completions.push_back(std::move(c));
      }
    }
    next_prompt = (next_prompt + static_cast<size_t>(rl.prompts_per_step)) % prompts.size();
    std::vector<double> rewards;
    if (!policy.scores_rewards()) {
      // Another rank of this replica scores the same rows.
    } else if (command) {
      rewards = (*command)(requests);
    } else {
      for (const RewardRequest& r : requests) {
        rewards.push_back(rl.reward == RewardKind::kExact ? exact_match(r.completion, r.answer)
                                                          : numeric_match(r.completion, r.answer, rl.numeric_tolerance));
      }
    }
    rewards = policy.replica_rewards(std::move(rewards), requests.size());
    const double rollout_seconds = timer.seconds();
    for (size_t i = 0; i < completions.size(); ++i) {
      const nlohmann::json line = {{"step", step},
                                   {"index", first_prompt * rl.group_size + static_cast<int64_t>(i)},
                                   {"completion", requests[i].completion},
                                   {"tokens", completions[i].tokens},
                                   {"reward", rewards[i]}};
      rollouts << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    }
    rollouts << std::flush;
    const torch::Tensor reward_t = torch::tensor(rewards, torch::kFloat64).to(torch::kFloat32);
    const torch::Tensor advantages = group_advantages(reward_t, rl.group_size, rl.scale_rewards);
    const Batch batch = make_batch(rows, completions);
    // The ratio's old log-probabilities recomputed by the training forward, as the single-process
    // loop does (rl_cli.cpp): the sampler's rounding differs with how the rows were decoded.
    const torch::Tensor old = policy.autocast([&] { return recomputed_logprobs(model, batch, rl.temperature); });
    // The sampler's against the training forward's, same weights (reported, not used).
    double max_logp_diff =
        ((old.detach().cpu().to(torch::kFloat32) - rollout_logprobs(rows, completions, batch)) * batch.mask)
            .abs()
            .max()
            .item<double>();
    // The global batch this rank's loss is a share of: rows, completion tokens, widest row.
    const double local_rows = static_cast<double>(completions.size());
    const double local_tokens = batch.mask.sum().item<double>();
    const double local_width = static_cast<double>(batch.mask.size(1));
    const std::vector<double> global = policy.sum_over_replicas({local_rows, local_tokens});
    const double scale = global_loss_scale(grpo.aggregation, local_rows, local_tokens, local_width, global[0],
                                           global[1], policy.max_over_replicas(local_width));
    torch::Tensor ref;
    if (grpo.kl_beta > 0) {
      torch::NoGradGuard no_grad;
      for (lora::Adapter* adapter : adapters) adapter->set_enabled(false);
      ref = policy.autocast([&] { return token_logprobs(model, batch, rl.temperature); });
      for (lora::Adapter* adapter : adapters) adapter->set_enabled(true);
    }
    GrpoLoss loss;
    ParallelPolicy::Update result;
    for (int64_t update = 0; update < rl.updates_per_rollout; ++update) {
      result = policy.update(
          [&] {
            const torch::Tensor logp = token_logprobs(model, batch, rl.temperature);
            // In float64: the per-token terms are of order 1 and cancel to about the update's
            // size, so a float32 sum's rounding would be a visible share of the loss, and differ
            // with the order of the sum (the layout).
            const auto f64 = [&](const torch::Tensor& t) {
              return t.defined() ? t.to(logp.device(), torch::kFloat64) : t;
            };
            loss = grpo_loss(f64(logp), f64(old), f64(ref), f64(advantages), f64(batch.mask), grpo);
            return loss.loss * scale;
          },
          job.training.max_norm);
    }
    // Over every rank: the global loss (the sum of the shares), token-weighted means, the rewards.
    const std::vector<double> sums = policy.sum_over_replicas(
        {result.loss.item<double>(), loss.kl * local_tokens, loss.clipped_low * local_tokens,
         loss.clipped_high * local_tokens, loss.ratio * local_tokens, reward_t.sum().item<double>()});
    max_logp_diff = policy.max_over_replicas(max_logp_diff);
    const double global_loss = sums[0];
    const double kl = sums[1] / global[1], clipped_low = sums[2] / global[1], clipped_high = sums[3] / global[1],
                 ratio = sums[4] / global[1];
    const double mean_reward = sums[5] / global[0];
    const double mean_len = global[1] / global[0];
    const double grad_norm = result.grad_norm;
    if (main_rank) {
      nlohmann::json line = {{"step", step},
                             {"reward", mean_reward},
                             {"loss", global_loss},
                             {"kl", kl},
                             {"clipped_low", clipped_low},
                             {"clipped_high", clipped_high},
                             {"ratio", ratio},
                             {"grad_norm", grad_norm},
                             {"lr", result.lr},
                             {"completion_tokens", mean_len},
                             {"rollout_logp_max_diff", max_logp_diff},
                             {"rollout_seconds", rollout_seconds},
                             {"step_seconds", timer.seconds()}};
      metrics << line.dump() << "\n" << std::flush;
      std::printf("step %4ld  reward %.3f  loss %+.4f  kl %.4f  clip %.3f/%.3f  grad_norm %.3f  len %.1f  %.2fs\n",
                  static_cast<long>(step), mean_reward, global_loss, kl, clipped_low, clipped_high, grad_norm, mean_len,
                  timer.seconds());
      std::fflush(stdout);
    }
    if (rl.save_every > 0 && step % rl.save_every == 0 && step != job.training.steps) save(step);
  }
  save(job.training.steps);
}

}  // namespace loom::rl
