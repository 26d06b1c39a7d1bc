#include "loom/rl/rl_cli.h"

#include <toml++/toml.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/error_report.h"
#include "loom/core/logging.h"
#include "loom/core/timer.h"
#include "loom/data/tokenizer.h"
#include "loom/lora/lora.h"
#include "loom/models/common/adapter_dir.h"
#include "loom/models/common/model_dir.h"
#include "loom/rl/adapter_update.h"
#include "loom/rl/grpo.h"
#include "loom/rl/revisions.h"
#include "loom/rl/policies.h"
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

// The single-process loop: batched rollouts, several policies over one base, PEFT revisions with
// resume and rollback.
void run_local_rl(const train::JobConfig& job, const RlConfig& rl, const data::Tokenizer& tokenizer) {
  const std::string base = job.checkpoint.initial_load_path;
  const models::ModelDirArgs recorded = models::read_model_dir_args(base);
  const std::vector<Prompt> prompts =
      read_prompts(rl.prompts, tokenizer, rl.add_bos, rl.max_new_tokens, recorded.decoder().max_seq_len);
  std::unique_ptr<ExternalReward> command;
  if (rl.reward == RewardKind::kCommand) {
    command = std::make_unique<ExternalReward>(rl.reward_command, std::chrono::seconds(rl.reward_timeout_seconds));
  }

  torch::manual_seed(job.training.seed);
  models::LoadOptions load;
  const auto loaded = models::load_model_dir(base, load);
  LOOM_REQUIRE_USAGE(!loaded.adapter, "checkpoint.initial_load_path '", base, "' is an adapter; give its base");
  models::Decoder& model = *loaded.model;
  model.eval();
  LOOM_REQUIRE_USAGE(loaded.spec->hf.has_value(), "model '", loaded.spec->name, "' has no LoRA target names");
  const lora::LoRAOptions lora_options = lora::LoRAOptions::from(job.lora);
  // rl.policies: one adapter per policy over this one base (rl/policies.h); policy k is seeded
  // training.seed + k, so it equals a one-policy run with that seed.
  const std::vector<std::string> policy_names = split_policy_names(rl.policies);
  const int64_t policy_count = std::max<int64_t>(1, static_cast<int64_t>(policy_names.size()));
  LOOM_REQUIRE_USAGE(policy_count == 1 || (!rl.resume && rl.rollback.empty()),
                     "rl.resume and rl.rollback continue one policy's revision; with rl.policies = \"", rl.policies,
                     "\" start a fresh run (resuming several policies is not built)");
  const fs::path dump(job.job.dump_folder);
  const fs::path adapters_dir = dump / "adapters";
  // A resumed or rolled-back run starts from a revision's adapters, optimizer state and cursor.
  const std::optional<fs::path> start = revision_to_start_from(rl.resume, rl.rollback, adapters_dir);
  RevisionInfo start_info;
  if (start) {
    start_info = read_revision(*start);
    const models::AdapterDir adapter = models::read_adapter_dir(*start);
    std::vector<std::string> want = lora_options.target_modules;
    std::sort(want.begin(), want.end());
    LOOM_REQUIRE_USAGE(adapter.options.rank == lora_options.rank && adapter.options.alpha == lora_options.alpha &&
                           adapter.options.target_modules == want,
                       "revision '", start->string(), "' holds ", adapter.describe(), ", but [lora] asks for rank ",
                       lora_options.rank, ", alpha ", lora_options.alpha, "; give [lora] the revision's settings");
    models::check_adapter_base(adapter, base);
    models::attach_adapter(*loaded.spec, model, adapter);
    log::info("rl: continuing from ", start->string(), " (step ", start_info.step, ")");
  } else {
    const lora::LoRAReport report = lora::apply_lora(model, lora_options, models::hf_module_names(*loaded.spec->hf));
    init_adapters(model, static_cast<uint64_t>(job.training.seed));
    log::info("rl: ", report.describe());
  }
  PolicySet policies(model, policy_count);
  for (int64_t k = 1; k < policy_count; ++k) {
    policies.bind(k);
    init_adapters(model, static_cast<uint64_t>(job.training.seed + k));
  }
  // Each policy its own optimizer and schedule, over its own adapter tensors (bound when built).
  std::vector<std::unique_ptr<AdapterOptimizer>> optimizers;
  for (int64_t k = 0; k < policy_count; ++k) {
    policies.bind(k);
    optimizers.push_back(std::make_unique<AdapterOptimizer>(model, job, job.training.steps * rl.updates_per_rollout));
  }
  policies.bind(0);
  if (start) load_revision_state(*start, *optimizers.front());
  const nlohmann::json base_reference = models::base_reference(base);
  std::vector<RewardStats> reward_stats(static_cast<size_t>(policy_count));

  fs::create_directories(dump / "rollouts");
  std::ofstream metrics(dump / "metrics.jsonl", std::ios::app);
  // Every sampled completion by its index in its policy's step (as parallel_loop.cpp's ranks write
  // theirs, so the two compare line for line).
  std::ofstream rollouts(dump / "rollouts" / "rank0.jsonl", std::ios::app);
  const models::SamplingOptions sampling = rl.sampling(tokenizer.eos_id());
  const GrpoOptions grpo = rl.grpo();
  size_t next_prompt = static_cast<size_t>(start_info.prompt_cursor) % prompts.size();
  const auto save = [&](int64_t step) {
    for (int64_t k = 0; k < policy_count; ++k) {
      policies.bind(k);
      RevisionInfo info;
      info.step = step;
      info.prompt_cursor = static_cast<int64_t>(next_prompt);
      info.rewards = reward_stats[static_cast<size_t>(k)].to_json();
      info.base = base_reference;
      // One policy: adapters/step-N; several: adapters/<policy>/step-N.
      const fs::path dir = write_revision(policy_names.empty() ? adapters_dir : adapters_dir / policy_names[k],
                                          *loaded.spec, model, lora_options, *optimizers[static_cast<size_t>(k)], info);
      reward_stats[static_cast<size_t>(k)].clear();
      log::info("rl: revision saved to ", dir.string());
    }
    policies.bind(0);
  };
  if (start_info.step >= job.training.steps) {
    log::info("rl: ", start->string(), " is at step ", start_info.step, ", training.steps = ", job.training.steps,
              ": nothing left to run");
    return;
  }

  const int64_t per_policy = rl.prompts_per_step * rl.group_size;  // completions of one policy per step
  for (int64_t step = start_info.step + 1; step <= job.training.steps; ++step) {
    Timer timer;
    // Every policy's completions, decoded together (policy k's are rows k * per_policy ..); each
    // samples from its policy's stream: completion_seed(training.seed + k, step, index in the policy).
    std::vector<std::vector<int64_t>> all_rows;
    std::vector<at::Generator> generators;
    std::vector<int64_t> policy_of_row;
    std::vector<const Prompt*> prompt_of_row;
    for (int64_t k = 0; k < policy_count; ++k) {
      size_t cursor = next_prompt;
      for (int64_t p = 0; p < rl.prompts_per_step; ++p) {
        const Prompt& prompt = prompts[cursor];
        cursor = (cursor + 1) % prompts.size();
        for (int64_t g = 0; g < rl.group_size; ++g) {
          generators.push_back(at::make_generator<at::CPUGeneratorImpl>(completion_seed(
              static_cast<uint64_t>(job.training.seed + k), step, p * rl.group_size + g)));
          all_rows.push_back(prompt.ids);
          policy_of_row.push_back(k);
          prompt_of_row.push_back(&prompt);
        }
      }
    }
    next_prompt = (next_prompt + static_cast<size_t>(rl.prompts_per_step)) % prompts.size();
    std::vector<Completion> all_completions;
    if (policy_count == 1) {
      all_completions = sample_completions(model, all_rows, sampling, generators);
    } else {
      PolicySet::RowAdapters row_adapters(policies, policy_of_row, lora_options.scaling());
      all_completions = sample_completions(model, all_rows, sampling, generators,
                                           [&](const std::vector<int64_t>& rows) { row_adapters.set_rows(rows); });
    }
    std::vector<RewardRequest> all_requests;
    for (size_t i = 0; i < all_completions.size(); ++i) {
      std::vector<int64_t> text_ids = all_completions[i].tokens;
      if (!text_ids.empty() && text_ids.back() == sampling.stop_id) text_ids.pop_back();
      all_requests.push_back({prompt_of_row[i]->text, tokenizer.decode(text_ids, /*skip_special=*/true),
                              prompt_of_row[i]->answer});
    }
    std::vector<double> all_rewards;
    if (command) {
      all_rewards = (*command)(all_requests);
    } else {
      for (const RewardRequest& r : all_requests) {
        all_rewards.push_back(rl.reward == RewardKind::kExact ? exact_match(r.completion, r.answer)
                                                              : numeric_match(r.completion, r.answer, rl.numeric_tolerance));
      }
    }
    const double rollout_seconds = timer.seconds();
    for (size_t i = 0; i < all_completions.size(); ++i) {
      nlohmann::json line = {{"step", step},
                             {"index", static_cast<int64_t>(i) % per_policy},
                             {"completion", all_requests[i].completion},
                             {"tokens", all_completions[i].tokens},
                             {"reward", all_rewards[i]}};
      if (!policy_names.empty()) line["policy"] = policy_names[static_cast<size_t>(policy_of_row[i])];
      rollouts << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    }
    rollouts << std::flush;
    // The updates: each policy on its own rows, with its own optimizer, advantages and clipping.
    for (int64_t k = 0; k < policy_count; ++k) {
      policies.bind(k);
      const auto from = static_cast<std::ptrdiff_t>(k * per_policy);
      const auto to = from + static_cast<std::ptrdiff_t>(per_policy);
      const std::vector<std::vector<int64_t>> rows(all_rows.begin() + from, all_rows.begin() + to);
      const std::vector<Completion> completions(all_completions.begin() + from, all_completions.begin() + to);
      const std::vector<double> rewards(all_rewards.begin() + from, all_rewards.begin() + to);
      AdapterOptimizer& optimizer = *optimizers[static_cast<size_t>(k)];
      reward_stats[static_cast<size_t>(k)].add(rewards);
      const torch::Tensor reward_t = torch::tensor(rewards, torch::kFloat64).to(torch::kFloat32);
      const torch::Tensor advantages = group_advantages(reward_t, rl.group_size, rl.scale_rewards);
      const Batch batch = make_batch(rows, completions);
      // The ratio's old log-probabilities: the rollout policy's, recomputed by the training forward
      // (the same weights) rather than the sampler's, whose rounding depends on how the rows were
      // decoded (batched here, one at a time under parallelism): the first update's ratio is then
      // exactly 1, and the loss the same whatever the layout (parallel_loop.cpp does the same).
      const torch::Tensor old = recomputed_logprobs(model, batch, rl.temperature);
      // The sampler's against the training forward's, same weights (reported, not used).
      const double max_logp_diff =
          ((old - rollout_logprobs(rows, completions, batch)) * batch.mask).abs().max().item<double>();
      const torch::Tensor ref = grpo.kl_beta > 0 ? reference_logprobs(model, batch, rl.temperature) : torch::Tensor();
      const PolicyUpdate update =
          update_policy(model, optimizer, batch, old, ref, advantages, grpo, rl.temperature, rl.updates_per_rollout);
      const GrpoLoss& loss = update.loss;
      const double grad_norm = update.grad_norm;
      const double mean_reward = reward_t.mean().item<double>();
      const double mean_len = batch.mask.sum().item<double>() / static_cast<double>(completions.size());
      nlohmann::json line = {{"step", step},
                             {"reward", mean_reward},
                             {"loss", loss.loss.item<double>()},
                             {"kl", loss.kl},
                             {"clipped_low", loss.clipped_low},
                             {"clipped_high", loss.clipped_high},
                             {"ratio", loss.ratio},
                             {"grad_norm", grad_norm},
                             {"lr", update.lr},
                             {"completion_tokens", mean_len},
                             {"rollout_logp_max_diff", max_logp_diff},
                             {"rollout_seconds", rollout_seconds},
                             {"step_seconds", timer.seconds()}};
      if (!policy_names.empty()) line["policy"] = policy_names[static_cast<size_t>(k)];
      metrics << line.dump() << "\n" << std::flush;
      if (!policy_names.empty()) std::printf("%-8s ", policy_names[static_cast<size_t>(k)].c_str());
      std::printf("step %4ld  reward %.3f  loss %+.4f  kl %.4f  clip %.3f/%.3f  grad_norm %.3f  len %.1f  %.2fs\n",
                  static_cast<long>(step), mean_reward, loss.loss.item<double>(), loss.kl, loss.clipped_low,
                  loss.clipped_high, grad_norm, mean_len, timer.seconds());
      std::fflush(stdout);
    }
    policies.bind(0);
    if (rl.save_every > 0 && step % rl.save_every == 0 && step != job.training.steps) save(step);
  }
  save(job.training.steps);
}

}  // namespace

bool parallel_job(const train::JobConfig& job) {
  const char* world = std::getenv("WORLD_SIZE");
  const parallel::ParallelismConfig& par = job.parallelism;
  return (world != nullptr && std::atoi(world) > 1) || par.data_parallel_shard_degree > 1 ||
         par.data_parallel_replicate_degree > 1 || par.tensor_parallel_degree > 1 ||
         par.context_parallel_degree > 1 || par.pipeline_parallel_degree > 1 || par.expert_parallel_degree > 1;
}

void run_rl(const std::string& config_path, const std::vector<std::string>& overrides) {
  const std::pair<train::JobConfig, RlConfig> configs = load_rl_config(config_path, overrides);
  const train::JobConfig& job = configs.first;
  const RlConfig& rl = configs.second;
  LOOM_REQUIRE_USAGE(!job.checkpoint.initial_load_path.empty(),
                     "loom rl needs checkpoint.initial_load_path: the model (an SFT run's checkpoint) to train");
  LOOM_REQUIRE_USAGE(job.lora.rank > 0, "loom rl trains LoRA adapters: set lora.rank > 0");
  const data::Tokenizer tokenizer = data::Tokenizer::from_file(job.model.tokenizer_path);
  if (parallel_job(job)) {
    run_parallel_rl(job, rl, tokenizer);
  } else {
    run_local_rl(job, rl, tokenizer);
  }
}

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

std::pair<train::JobConfig, RlConfig> load_rl_config(const std::string& path,
                                                    const std::vector<std::string>& overrides) {
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
  // Several policies run in one process only: the per-row adapters of a rollout and the policy
  // binding are not built for sharded (FSDP) or split (TP) adapters.
  LOOM_REQUIRE_USAGE(split_policy_names(rl.policies).size() <= 1 || !parallel_job(job), "rl.policies = \"", rl.policies,
                     "\" (several policies over one base) runs in one process only; run it without loom launch and"
                     " parallelism degrees, or train one policy per job");
  return {std::move(job), std::move(rl)};
}

void register_rl_command(CLI::App& app) {
  auto config = std::make_shared<std::string>();
  auto reference = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("rl", "GRPO on LoRA adapters: sample, score, update (config with an [rl] section; "
                                           "one rank, use 'loom launch' for several)");
  cmd->add_option("--config", *config, "Job config TOML with an [rl] section")->check(CLI::ExistingFile);
  cmd->add_flag("--config-reference", *reference, "Print the [rl] keys (type, default, meaning) as Markdown and exit");
  cmd->allow_extras();
  cmd->footer("Any config key can be overridden: --section.key=value, --rl.key=value.");
  cmd->callback([cmd, config, reference] {
    if (*reference) {
      std::fputs(rl_reference_markdown().c_str(), stdout);
      return;
    }
    try {
      LOOM_REQUIRE_USAGE(!config->empty(), "loom rl needs --config FILE (a job config with an [rl] section)");
      run_rl(*config, cmd->remaining());
    } catch (...) {
      report_current_exception_and_exit();  // as `loom train`
    }
  });
}

}  // namespace loom::rl
