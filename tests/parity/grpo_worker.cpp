// Runs `loom rl`'s GRPO updates on fixed rollouts, for the PyTorch + peft reference check
// tests/parity/test_grpo_peft_parity.py:
//   loom_grpo_parity_worker CONFIG ROLLOUTS ADAPTER OUT
// CONFIG: a `loom rl` job config (rl/rl_cli.h's load_rl_config): the base is
//   checkpoint.initial_load_path, the GRPO, optimizer, LR-schedule and clipping settings are its
//   [rl], [optimizer], [lr_scheduler] and training.max_norm.
// ROLLOUTS: JSON {"steps": [{"prompts": [[id, ...], ...], "completions": [[id, ...], ...],
//   "logp": [[rollout log-prob of each completion token], ...], "rewards": [...]}, ...]}, one row
//   per completion, the G of a prompt consecutive.
// ADAPTER: a PEFT directory, the adapters the updates start from.
// OUT: safetensors with, for update u (counted over all steps, rl.updates_per_rollout per step),
//   "u.loss", "u.grad_norm" (before clipping), "u.lr" (0-dim float64) and "u.grad.<PEFT name>" (the
//   gradient before clipping), and "final.<PEFT name>" (the adapters after the last update). PEFT
//   names are adapter_model.safetensors' (base_model.model.<HF module>.lora_A.weight).
// The updates go through the loop's own code: rollout.h's batch and log-probabilities,
// grpo.h's advantages and loss, adapter_update.h's reference, optimizer, schedule and clipping.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/models/common/adapter_dir.h"
#include "loom/models/common/model_dir.h"
#include "loom/rl/adapter_update.h"
#include "loom/rl/grpo.h"
#include "loom/rl/rl_cli.h"
#include "loom/rl/rollout.h"

namespace {
using namespace loom;

// "layers.0.attention.wq.lora.a" -> "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".
std::string peft_name(const std::string& name, const lora::HfModuleName& hf_names) {
  const bool a = name.size() > 7 && name.compare(name.size() - 7, 7, ".lora.a") == 0;
  const auto hf = hf_names(name.substr(0, name.size() - 7));
  LOOM_REQUIRE(hf.has_value(), "no Hugging Face module for ", name);
  return "base_model.model." + *hf + (a ? ".lora_A.weight" : ".lora_B.weight");
}

torch::Tensor scalar(double v) { return torch::scalar_tensor(v, torch::kFloat64); }
}  // namespace

int main(int argc, char** argv) {
  try {
    LOOM_REQUIRE_USAGE(argc == 5, "usage: loom_grpo_parity_worker CONFIG ROLLOUTS ADAPTER OUT");
    const auto [job, rl] = rl::load_rl_config(argv[1]);
    const auto loaded = models::load_model_dir(job.checkpoint.initial_load_path);
    models::Decoder& model = *loaded.model;
    model.eval();
    models::attach_adapter(*loaded.spec, model, models::read_adapter_dir(argv[3]));
    const lora::HfModuleName hf_names = models::hf_module_names(*loaded.spec->hf);
    const nlohmann::json rollouts = nlohmann::json::parse(std::ifstream(argv[2]));
    const int64_t steps = static_cast<int64_t>(rollouts.at("steps").size());
    rl::AdapterOptimizer optimizer(model, job, steps * rl.updates_per_rollout);
    const rl::GrpoOptions grpo = rl.grpo();
    checkpoint::NamedTensors out;
    int64_t update = 0;
    for (const nlohmann::json& step : rollouts.at("steps")) {
      const auto prompts = step.at("prompts").get<std::vector<std::vector<int64_t>>>();
      const auto tokens = step.at("completions").get<std::vector<std::vector<int64_t>>>();
      const auto logp = step.at("logp").get<std::vector<std::vector<double>>>();
      std::vector<rl::Completion> completions;
      for (size_t i = 0; i < tokens.size(); ++i) completions.push_back({tokens[i], logp[i]});
      const rl::Batch batch = rl::make_batch(prompts, completions);
      const torch::Tensor old = rl::rollout_logprobs(prompts, completions, batch);
      const torch::Tensor rewards = torch::tensor(step.at("rewards").get<std::vector<double>>(), torch::kFloat64);
      const torch::Tensor advantages = rl::group_advantages(rewards, rl.group_size, rl.scale_rewards);
      const torch::Tensor ref =
          grpo.kl_beta > 0 ? rl::reference_logprobs(model, batch, rl.temperature) : torch::Tensor();
      for (int64_t u = 0; u < rl.updates_per_rollout; ++u, ++update) {
        const std::string prefix = std::to_string(update) + ".";
        const rl::PolicyUpdate result = rl::update_policy(
            model, optimizer, batch, old, ref, advantages, grpo, rl.temperature, 1,
            [&](const optim::NamedTensors& trained) {
              for (const auto& [name, param] : trained) {
                out.emplace_back(prefix + "grad." + peft_name(name, hf_names), param.grad().detach().clone());
              }
            });
        out.emplace_back(prefix + "loss", scalar(result.loss.loss.item<double>()));
        out.emplace_back(prefix + "grad_norm", scalar(result.grad_norm));
        out.emplace_back(prefix + "lr", scalar(result.lr));
        std::printf("update %ld: loss %.8f grad_norm %.6f lr %.3e clipped %.3f/%.3f kl %.6f\n",
                    static_cast<long>(update), result.loss.loss.item<double>(), result.grad_norm, result.lr,
                    result.loss.clipped_low, result.loss.clipped_high, result.loss.kl);
      }
    }
    for (const auto& [name, param] : optimizer.trained()) {
      out.emplace_back("final." + peft_name(name, hf_names), param.detach().clone());
    }
    checkpoint::save_safetensors(argv[4], out);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
