#include "loom/rl/rl_cli.h"

#include <toml++/toml.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/timer.h"
#include "loom/data/tokenizer.h"
#include "loom/lora/lora.h"
#include "loom/models/common/adapter_dir.h"
#include "loom/models/common/model_dir.h"
#include "loom/core/error_report.h"
#include "loom/rl/grpo.h"
#include "loom/rl/parallel_policy.h"
#include "loom/rl/rewards.h"
#include "loom/rl/rollout.h"

namespace loom::rl {
namespace {
namespace fs = std::filesystem;

void set_rl_key(RlConfig& rl, const options::Key& key, const toml::node& node, const std::string& where) {
  const std::string name = c10::str("rl.", key.name);
  auto wrong = [&] {
    LOOM_REQUIRE_USAGE(false, "config key '", name, "' expects ", key.type_description(), " in ", where);
  };
  std::visit(
      [&](auto field) {
        using T = decltype(field);
        if constexpr (std::is_same_v<T, bool*>) {
          if (!node.is_boolean()) wrong();
          *field = *node.value<bool>();
        } else if constexpr (std::is_same_v<T, int64_t*>) {
          if (!node.is_integer()) wrong();
          *field = *node.value<int64_t>();
        } else if constexpr (std::is_same_v<T, double*>) {
          if (!node.is_number()) wrong();
          *field = *node.value<double>();
        } else if constexpr (std::is_same_v<T, std::string*>) {
          if (!node.is_string()) wrong();
          *field = *node.value<std::string>();
        } else if constexpr (std::is_same_v<T, options::EnumRef>) {
          if (!node.is_string()) wrong();
          const std::string value = *node.value<std::string>();
          LOOM_REQUIRE_USAGE(field.codec->set(field.field, value), "config key '", name, "' must be one of ",
                             options::join_choices(field.codec->names), ", got '", value, "' in ", where);
        } else {
          wrong();
        }
      },
      key.field(&rl));
}

// --rl.NAME=VALUE: the value as its key's TOML (a string key's as the text itself).
void set_rl_override(RlConfig& rl, const std::string& name, const std::string& value, const std::string& where) {
  const options::Section& section = rl_section();
  const options::Key* key = section.find(name);
  if (key == nullptr) {
    std::vector<std::string_view> names;
    for (const options::Key& k : section.keys) names.push_back(k.name);
    LOOM_REQUIRE_USAGE(false, "unknown config key 'rl.", name, "' in ", where, " (did you mean 'rl.",
                       options::nearest(name, names), "'?)");
  }
  const bool text = std::visit(
      [](auto field) {
        using T = decltype(field);
        return std::is_same_v<T, std::string*> || std::is_same_v<T, options::EnumRef>;
      },
      key->field(&rl));
  toml::table doc;
  try {
    doc = toml::parse(c10::str("value = ", text ? options::toml_string(value) : value), where);
  } catch (const toml::parse_error&) {
    LOOM_REQUIRE_USAGE(false, "config key 'rl.", name, "' expects ", key->type_description(), ", got '", value,
                       "' in ", where);
  }
  set_rl_key(rl, *key, *doc.get("value"), where);
}

void run_rl(const std::string& config_path, const std::vector<std::string>& overrides) {
  const std::pair<train::JobConfig, RlConfig> configs = load_rl_config(config_path, overrides);
  const train::JobConfig& job = configs.first;
  const RlConfig& rl = configs.second;
  LOOM_REQUIRE_USAGE(!job.checkpoint.initial_load_path.empty(),
                     "loom rl needs checkpoint.initial_load_path: the model (an SFT run's checkpoint) to train");
  LOOM_REQUIRE_USAGE(job.lora.rank > 0, "loom rl trains LoRA adapters: set lora.rank > 0");
  const data::Tokenizer tokenizer = data::Tokenizer::from_file(job.model.tokenizer_path);
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
  models::SamplingOptions sampling;
  sampling.max_new_tokens = rl.max_new_tokens;
  sampling.temperature = rl.temperature;
  sampling.top_p = rl.top_p;
  sampling.top_k = rl.top_k;
  sampling.stop_id = tokenizer.eos_id();
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
    const torch::Tensor old = rollout_logprobs(rows, completions, batch);
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
    double max_logp_diff = 0;  // the first update's: rollout vs training forward, same weights
    for (int64_t update = 0; update < rl.updates_per_rollout; ++update) {
      result = policy.update(
          [&] {
            const torch::Tensor logp = token_logprobs(model, batch, rl.temperature);
            if (update == 0) max_logp_diff = ((logp.detach().cpu() - old) * batch.mask).abs().max().item<double>();
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

}  // namespace

std::vector<Prompt> read_prompts(const std::string& path, const data::Tokenizer& tokenizer, bool add_bos,
                                 int64_t max_new_tokens, int64_t max_seq_len) {
  std::ifstream in(path);
  LOOM_REQUIRE_USAGE(in.good(), "cannot read rl.prompts '", path, "'");
  std::vector<Prompt> out;
  std::string line;
  for (int64_t no = 1; std::getline(in, line); ++no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception&) {
      LOOM_REQUIRE_USAGE(false, path, ":", no, ": not a JSON object");
    }
    LOOM_REQUIRE_USAGE(j.is_object() && j.contains("prompt") && j["prompt"].is_string(), path, ":", no,
                       ": needs a string \"prompt\"");
    Prompt p;
    p.text = j["prompt"].get<std::string>();
    if (j.contains("answer")) p.answer = j["answer"].is_string() ? j["answer"].get<std::string>() : j["answer"].dump();
    p.ids = tokenizer.encode(p.text, add_bos && tokenizer.bos_id() >= 0, false);
    LOOM_REQUIRE_USAGE(!p.ids.empty(), path, ":", no, ": the prompt is empty");
    try {
      models::check_generation_fits(static_cast<int64_t>(p.ids.size()), max_new_tokens, max_seq_len);
    } catch (const UsageError& e) {
      throw UsageError(c10::str(path, ":", no, ": ", e.what()));
    }
    out.push_back(std::move(p));
  }
  LOOM_REQUIRE_USAGE(!out.empty(), "rl.prompts '", path, "' holds no prompt");
  return out;
}

std::pair<train::JobConfig, RlConfig> load_rl_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  LOOM_REQUIRE_USAGE(in.good() && !fs::is_directory(path), "cannot read config file '", path, "'");
  std::stringstream text;
  text << in.rdbuf();
  toml::table root;
  try {
    root = toml::parse(text.str(), path);
  } catch (const toml::parse_error& e) {
    std::string d(e.description());
    std::replace(d.begin(), d.end(), '\n', ' ');
    LOOM_REQUIRE_USAGE(false, "malformed TOML in ", path, ": ", d);
  }
  RlConfig rl;
  const options::Section& section = rl_section();
  if (const toml::node* node = root.get("rl")) {
    LOOM_REQUIRE_USAGE(node->is_table(), "'rl' in ", path, " must be a [rl] table");
    for (auto&& [key, value] : *node->as_table()) {
      const std::string name(key.str());
      const options::Key* spec = section.find(name);
      if (spec == nullptr) {
        std::vector<std::string_view> names;
        for (const options::Key& k : section.keys) names.push_back(k.name);
        LOOM_REQUIRE_USAGE(false, "unknown config key 'rl.", name, "' in ", path, " (did you mean 'rl.",
                           options::nearest(name, names), "'?)");
      }
      set_rl_key(rl, *spec, value, c10::str(path, ":", key.source().begin.line));
    }
    root.erase("rl");
  } else {
    LOOM_REQUIRE_USAGE(false, "loom rl needs an [rl] section in ", path, " (rl.prompts at least)");
  }
  // Command-line overrides: --rl.key=value here, every other section's as `loom train` takes them.
  std::vector<std::string> job_overrides;
  for (size_t i = 0; i < overrides.size(); ++i) {
    const std::string& arg = overrides[i];
    if (arg.rfind("--rl.", 0) != 0) {
      job_overrides.push_back(arg);
      continue;
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(5, eq == std::string::npos ? std::string::npos : eq - 5);
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else {
      LOOM_REQUIRE_USAGE(i + 1 < overrides.size(), "config override '", arg, "' needs a value: --rl.", name,
                         "=VALUE");
      value = overrides[++i];
    }
    set_rl_override(rl, name, value, c10::str("command-line override '", arg, "'"));
  }
  section.validate(&rl);
  std::ostringstream rest;
  rest << root;
  train::JobConfig job = train::parse_config_toml(rest.str(), path);
  train::apply_overrides(job, job_overrides);
  train::validate(job);
  return {std::move(job), std::move(rl)};
}

void register_rl_command(CLI::App& app) {
  auto config = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("rl", "GRPO on LoRA adapters: sample, score, update (config with an [rl] section; "
                                           "one rank, use 'loom launch' for several)");
  cmd->add_option("--config", *config, "Job config TOML with an [rl] section")->required()->check(CLI::ExistingFile);
  cmd->allow_extras();
  cmd->footer("Any config key can be overridden: --section.key=value, --rl.key=value.");
  cmd->callback([cmd, config] {
    try {
      run_rl(*config, cmd->remaining());
    } catch (...) {
      // As `loom train`: reported at once; with several ranks the process ends without unwinding
      // into collectives the peers may never join (the report tells them to stop).
      const ErrorReport report = report_error(describe_exception(std::current_exception()));
      if (several_ranks_launched()) {
        std::fflush(stdout);
        std::fflush(stderr);
        std::_Exit(report.exit_code);
      }
      throw ReportedError(report.exit_code);
    }
  });
}

}  // namespace loom::rl
