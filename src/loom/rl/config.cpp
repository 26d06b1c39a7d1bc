#include "loom/rl/config.h"

#include <c10/util/StringUtil.h>

#include <cmath>
#include <set>

#include "loom/rl/policies.h"

namespace loom::rl {

const options::EnumNames<RewardKind>& option_names(RewardKind) {
  static const options::EnumNames<RewardKind> names = {
      {"exact", RewardKind::kExact}, {"numeric", RewardKind::kNumeric}, {"command", RewardKind::kCommand}};
  return names;
}

models::SamplingOptions RlConfig::sampling(int64_t stop_id) const {
  models::SamplingOptions s;
  s.max_new_tokens = max_new_tokens;
  s.temperature = temperature;
  s.top_p = top_p;
  s.top_k = top_k;
  s.stop_id = stop_id;
  return s;
}

GrpoOptions RlConfig::grpo() const {
  GrpoOptions o;
  o.clip_low = clip_low;
  o.clip_high = clip_high;
  o.kl_beta = kl_beta;
  o.aggregation = loss_type;
  o.max_completion_length = max_new_tokens;
  return o;
}

namespace {
void check(const RlConfig& c) {
  const options::Section& s = rl_section();
  options::require(!c.prompts.empty(), s, "prompts", "a JSONL file of {\"prompt\", \"answer\"} lines", &c);
  options::require(c.prompts_per_step >= 1, s, "prompts_per_step", "at least 1", &c);
  options::require(c.group_size >= 2, s, "group_size",
                   "at least 2 (advantages are relative to the other completions of the prompt)", &c);
  options::require(c.max_new_tokens >= 1, s, "max_new_tokens", "at least 1", &c);
  options::require(std::isfinite(c.temperature) && c.temperature > 0, s, "temperature",
                   "a finite number > 0 (GRPO needs sampled, not greedy, completions)", &c);
  options::require(std::isfinite(c.top_p) && c.top_p > 0 && c.top_p <= 1, s, "top_p", "in (0, 1]", &c);
  options::require(c.top_k >= 0, s, "top_k", "at least 0", &c);
  options::require(c.reward != RewardKind::kCommand || !c.reward_command.empty(), s, "reward_command",
                   "a shell command when rl.reward = \"command\"", &c);
  options::require(c.reward_timeout_seconds >= 1, s, "reward_timeout_seconds", "at least 1", &c);
  options::require(c.numeric_tolerance >= 0, s, "numeric_tolerance", "at least 0", &c);
  options::require(c.updates_per_rollout >= 1, s, "updates_per_rollout", "at least 1", &c);
  options::require(c.save_every >= 0, s, "save_every", "at least 0", &c);
  options::require(!c.resume || c.rollback.empty(), s, "rollback",
                   "unset when rl.resume = true (resume continues from the newest revision, rollback from the one"
                   " named)",
                   &c);
  std::set<std::string> names;
  for (const std::string& name : split_policy_names(c.policies)) {
    const bool safe = !name.empty() && name != "." && name != ".." &&
                      name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") ==
                          std::string::npos;
    options::require(safe, s, "policies",
                     "comma-separated names of letters, digits, '_', '.' or '-' (each names its adapters/<policy> folder)",
                     &c);
    options::require(names.insert(name).second, s, "policies", "names that are all different", &c);
  }
  c.grpo().validate();
}
}  // namespace

const options::Section& rl_section() {
  static const options::Section section{
      "rl",
      {
          {LOOM_OPTION(RlConfig, prompts), "`loom rl`: JSONL prompt file, one {\"prompt\": ..., \"answer\": ...} per line."},
          {LOOM_OPTION(RlConfig, prompts_per_step), "Prompts per step (P); taken in file order, wrapping around."},
          {LOOM_OPTION(RlConfig, group_size), "Completions sampled per prompt (G, at least 2): one GRPO group."},
          {LOOM_OPTION(RlConfig, max_new_tokens), "Most tokens per completion (it also stops at the tokenizer's EOS)."},
          {LOOM_OPTION(RlConfig, temperature), "Sampling temperature (> 0); log-probabilities are of logits / temperature."},
          {LOOM_OPTION(RlConfig, top_p), "Nucleus sampling, in (0, 1]."},
          {LOOM_OPTION(RlConfig, top_k), "Sample among the k most likely tokens; 0 = all."},
          {LOOM_OPTION(RlConfig, reward),
           "`exact` (the trimmed completion equals the answer), `numeric` (its last number equals the answer's), or"
           " `command` (rl.reward_command: JSON lines in, one reward per line out)."},
          {LOOM_OPTION(RlConfig, reward_command), "Shell command scoring a batch (rl.reward = \"command\")."},
          {LOOM_OPTION(RlConfig, reward_timeout_seconds), "Seconds the reward command may take per batch."},
          {LOOM_OPTION(RlConfig, numeric_tolerance), "rl.reward = \"numeric\": the largest difference still rewarded."},
          {LOOM_OPTION(RlConfig, clip_low), "GRPO's epsilon_low: the ratio is clipped below 1 - clip_low."},
          {LOOM_OPTION(RlConfig, clip_high), "GRPO's epsilon_high: the ratio is clipped above 1 + clip_high."},
          {LOOM_OPTION(RlConfig, kl_beta), "Weight of the k3 KL to the base (the adapters zeroed); 0 = none."},
          {LOOM_OPTION(RlConfig, loss_type), "`grpo` (per-sequence mean), `bnpo` (token mean) or `dr_grpo`."},
          {LOOM_OPTION(RlConfig, scale_rewards), "`group`: advantages divided by the group's std; `none`: not."},
          {LOOM_OPTION(RlConfig, updates_per_rollout),
           "Optimizer steps on each batch of rollouts (GRPO's mu); above 1 the ratio leaves 1 and clipping acts."},
          {LOOM_OPTION(RlConfig, save_every),
           "Write a revision every this many steps (and at the end; 0 = at the end only): "
           "`job.dump_folder/adapters/step-N`, a PEFT directory with `loom_revision.json` (step, reward statistics, "
           "the base's checksum) and `rl_state.safetensors` (optimizer and LR-schedule state)."},
          {LOOM_OPTION(RlConfig, add_bos), "Prepend the tokenizer's BOS to each prompt (SFT data has none)."},
          {LOOM_OPTION(RlConfig, resume),
           "Continue from the newest revision in `job.dump_folder/adapters` (adapters, optimizer, LR schedule, step, "
           "prompt cursor); a run without revisions there starts at step 1."},
          {LOOM_OPTION(RlConfig, rollback),
           "A revision directory (`.../adapters/step-N`) to restart from at step N + 1; this run's later revisions "
           "are moved aside to `adapters/rolled-back-<unix time>/`, never deleted."},
          {LOOM_OPTION(RlConfig, policies),
           "Several policies over one base: comma-separated names, one LoRA adapter each, trained concurrently"
           " (rollouts decoded in one batch, separate updates; policy k seeded training.seed + k); \"\" = one."},
      },
      {},
      {},
      &options::validate_as<RlConfig, check>};
  return section;
}

std::string rl_reference_markdown() {
  const RlConfig defaults;
  const options::Section& section = rl_section();
  const auto cell = [](std::string_view text) {  // '|' ends a table cell even in a code span (GFM)
    std::string escaped;
    for (char ch : text) escaped += ch == '|' ? std::string("\\|") : std::string(1, ch);
    return escaped;
  };
  std::string out = c10::str("## [", section.name, "]\n\n");
  out += "Read by `loom rl` only (docs/rl.md); the rest of its config is the sections above.\n\n";
  out += "| key | type | default | meaning |\n| --- | --- | --- | --- |\n";
  for (const options::Key& k : section.keys) {
    const std::string value = options::value_as_toml(k, &defaults);
    const std::string shown = value == "none" ? "unset" : c10::str("`", value, "`");
    out += c10::str("| `rl.", k.name, "` | ", k.doc_type(), " | ", cell(shown), " | ", cell(k.help), " |\n");
  }
  return out;
}

}  // namespace loom::rl

