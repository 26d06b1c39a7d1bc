// `loom rl`'s revisions (issue 51), end to end through the binary on a tiny base: what a revision
// holds, resuming after a reward command failed mid-run and rolling back to an earlier revision
// (both equal to the uninterrupted run step for step, adapters and optimizer state byte for byte),
// the refusal to write over a run's revisions, and `loom generate/score --adapter` serving them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/models/common/adapter_dir.h"
#include "loom/models/common/model_dir.h"
#include "loom/models/llama3/model.h"
#include "loom/models/spec.h"
#include "loom/rl/revisions.h"
#include "loom/testing/files.h"
#include "loom/testing/run.h"
#include "loom/testing/tiny_llama.h"

namespace {
namespace fs = std::filesystem;
using namespace loom;
namespace lt = loom::testing;

// A tiny Llama with the bundled tokenizer's 2048 tokens, saved as a Loom checkpoint.
void save_revision_test_base(const fs::path& dir, uint64_t seed) {
  llama3::ModelArgs args = lt::tiny_llama_args();
  args.vocab_size = 2048;
  args.max_seq_len = 32;
  llama3::Transformer model(args);
  model.init_weights(seed);
  models::save_loom_checkpoint(models::get_spec("llama3"), model, dir);
}

// The job config of the runs below: 6 steps of P = 2, G = 3 (3 prompts: the cursor wraps inside a
// step), a warmup (the schedule's state matters), a KL term, clipping, a revision every 2 steps.
std::string revision_test_config(const fs::path& root, const fs::path& dump, const std::string& reward_script,
                                 const std::string& extra_rl = "") {
  const fs::path path = dump.string() + c10::str(".", std::hash<std::string>{}(reward_script + extra_rl), ".toml");
  std::ofstream(path) << "[job]\ndump_folder = \"" << dump.string() << "\"\n"
                      << "[model]\nname = \"llama3\"\nflavor = \"debugmodel\"\ntokenizer_path = \""
                      << lt::source_path("data/default/tokenizer.json") << "\"\n"
                      << "[optimizer]\nlr = 1e-2\nweight_decay = 0.01\n"
                      << "[lr_scheduler]\nwarmup_steps = 3\n"
                      << "[training]\nsteps = 6\nseed = 3\nmax_norm = 0.5\n"
                      << "[lora]\nrank = 4\nalpha = 8.0\ntarget_modules = \"all-linear\"\n"
                      << "[checkpoint]\ninitial_load_path = \"" << (root / "base").string() << "\"\n"
                      << "[rl]\nprompts = \"" << (root / "prompts.jsonl").string() << "\"\n"
                      << "prompts_per_step = 2\ngroup_size = 3\nmax_new_tokens = 4\nkl_beta = 0.05\n"
                      << "reward = \"command\"\nreward_command = \"sh " << (root / reward_script).string() << "\"\n"
                      << "save_every = 2\n"
                      << extra_rl;
  return path.string();
}

lt::RunResult run_loom_rl(const std::string& config) {
  return lt::run("env OMP_NUM_THREADS=1 " + lt::loom_bin() + " rl --config " + config, 120);
}

// The last metrics row of each step (a rolled-back run logs its steps again).
std::map<int64_t, nlohmann::json> rows_by_step(const fs::path& dump) {
  std::map<int64_t, nlohmann::json> out;
  for (const nlohmann::json& row : lt::read_jsonl(dump / "metrics.jsonl")) out[row.at("step").get<int64_t>()] = row;
  return out;
}

void expect_same_steps(const fs::path& reference, const fs::path& other) {
  const auto a = rows_by_step(reference), b = rows_by_step(other);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (const auto& [step, row] : a) {
    SCOPED_TRACE(c10::str("step ", step));
    for (const char* key : {"reward", "loss", "grad_norm", "lr", "kl"}) {
      EXPECT_EQ(row.at(key).get<double>(), b.at(step).at(key).get<double>()) << key;
    }
  }
  for (const char* file : {"adapter_model.safetensors", rl::kRlStateFile}) {
    EXPECT_EQ(lt::file_bytes(reference / "adapters/step-6" / file), lt::file_bytes(other / "adapters/step-6" / file))
        << file;
  }
}
}  // namespace

TEST(RlRevisions, ResumeAndRollbackEqualAnUninterruptedRun) {
  const fs::path root = lt::temp_dir();
  save_revision_test_base(root / "base", 5);
  lt::write(root / "prompts.jsonl",
                 "{\"prompt\": \"1+2=\", \"answer\": \"3\"}\n{\"prompt\": \"4+4=\", \"answer\": \"8\"}\n"
                 "{\"prompt\": \"2+5=\", \"answer\": \"7\"}\n");
  // A reward the completions' text moves (the JSON line's length mod 5, over 4), and the same one
  // from a backend that fails on its 5th call (step 5).
  lt::write(root / "reward.sh", "awk '{ print (length($0) % 5) / 4 }'\n");
  lt::write(root / "flaky.sh", c10::str("n=$(cat ", (root / "calls").string(), " 2>/dev/null || echo 0); n=$((n+1)); echo $n > ",
                                             (root / "calls").string(), "\nif [ $n -ge 5 ]; then echo 'reward backend down' >&2; exit 3; fi\n",
                                             "awk '{ print (length($0) % 5) / 4 }'\n"));
  const fs::path whole = root / "whole", broken = root / "broken";

  const lt::RunResult uninterrupted = run_loom_rl(revision_test_config(root, whole, "reward.sh"));
  ASSERT_EQ(uninterrupted.exit_code, 0) << uninterrupted.output;
  EXPECT_EQ(rl::list_revisions(whole / "adapters").size(), 3u);
  // The rewards move, and the gradients are not zero: the comparisons below compare something.
  double norms = 0;
  for (const auto& [step, row] : rows_by_step(whole)) norms += row.at("grad_norm").get<double>();
  EXPECT_GT(norms, 0.0);

  // What a revision holds: its step, the cursor, the rewards of steps 5 and 6 (2 x 2 x 3), the base.
  const rl::RevisionInfo info = rl::read_revision(whole / "adapters/step-6");
  EXPECT_EQ(info.step, 6);
  EXPECT_EQ(info.prompt_cursor, (6 * 2) % 3);
  EXPECT_EQ(info.rewards.at("count").get<int64_t>(), 12);
  EXPECT_LE(info.rewards.at("min").get<double>(), info.rewards.at("mean").get<double>());
  EXPECT_LE(info.rewards.at("mean").get<double>(), info.rewards.at("max").get<double>());
  EXPECT_EQ(info.base, models::base_reference(root / "base"));

  // The reward command fails in step 5: one line naming it, exit non-zero, revisions 2 and 4 kept.
  const lt::RunResult failed = run_loom_rl(revision_test_config(root, broken, "flaky.sh"));
  EXPECT_NE(failed.exit_code, 0);
  EXPECT_NE(failed.output.find("reward backend down"), std::string::npos) << failed.output;
  ASSERT_EQ(rl::list_revisions(broken / "adapters").size(), 2u) << failed.output;
  EXPECT_EQ(rl::read_revision(broken / "adapters/step-4").step, 4);

  // A fresh run into a folder with revisions refuses to start.
  const lt::RunResult fresh = run_loom_rl(revision_test_config(root, broken, "reward.sh"));
  EXPECT_EQ(fresh.exit_code, 2);
  EXPECT_NE(fresh.output.find("already holds revisions (newest step-4); set rl.resume = true"), std::string::npos)
      << fresh.output;

  // Resumed from step-4 with a working backend: steps 5 and 6 as the uninterrupted run's.
  const lt::RunResult resumed = run_loom_rl(revision_test_config(root, broken, "reward.sh", "resume = true\n"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("continuing from"), std::string::npos);
  expect_same_steps(whole, broken);

  // Rolled back to step-2: steps 3..6 again, the same; step-4 and step-6 moved aside, not deleted.
  const lt::RunResult rolled = run_loom_rl(revision_test_config(
      root, broken, "reward.sh", "rollback = \"" + (broken / "adapters/step-2").string() + "\"\n"));
  ASSERT_EQ(rolled.exit_code, 0) << rolled.output;
  expect_same_steps(whole, broken);
  int aside = 0;
  for (const auto& entry : fs::directory_iterator(broken / "adapters")) {
    if (entry.path().filename().string().rfind("rolled-back-", 0) != 0) continue;
    EXPECT_EQ(rl::list_revisions(entry.path()).size(), 2u);
    EXPECT_TRUE(fs::exists(entry.path() / "step-6/adapter_model.safetensors"));
    ++aside;
  }
  EXPECT_EQ(aside, 1);

  // rl.rollback naming something that is not a revision: one line.
  const lt::RunResult bad = run_loom_rl(revision_test_config(root, broken, "reward.sh", "rollback = \"" + root.string() + "\"\n"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("is not a loom rl revision"), std::string::npos) << bad.output;
}

TEST(RlRevisions, GenerateAndScoreServeARevision) {
  const fs::path root = lt::temp_dir();
  save_revision_test_base(root / "base", 5);
  save_revision_test_base(root / "other_base", 6);
  lt::write(root / "prompts.jsonl", "{\"prompt\": \"1+2=\", \"answer\": \"3\"}\n{\"prompt\": \"4+4=\", \"answer\": \"8\"}\n");
  lt::write(root / "reward.sh", "awk '{ print (length($0) % 5) / 4 }'\n");
  const lt::RunResult trained = run_loom_rl(revision_test_config(root, root / "run", "reward.sh"));
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string step2 = (root / "run/adapters/step-2").string(), step6 = (root / "run/adapters/step-6").string();
  const std::string base = (root / "base").string();

  const lt::RunResult generated =
      lt::run(c10::str(lt::loom_bin(), " generate --checkpoint ", base, " --adapter ", step6,
                            " --prompt-tokens 1,2,3 --max-new-tokens 4 --temperature 0 --ids"));
  ASSERT_EQ(generated.exit_code, 0) << generated.output;
  EXPECT_EQ(generated.output.find("trained on a base with checksum"), std::string::npos) << generated.output;

  const lt::RunResult scored = lt::run(c10::str(lt::loom_bin(), " score --checkpoint ", base,
                                                          " --tokens 1,17,250,3,999,42,7 --adapter ", step2,
                                                          " --adapter ", step6));
  ASSERT_EQ(scored.exit_code, 0) << scored.output;
  EXPECT_NE(scored.output.find("2 adapters scored over 1 base load"), std::string::npos) << scored.output;

  // A revision served on another base: the recorded checksum differs, and loom says so.
  const lt::RunResult elsewhere = lt::run(c10::str(lt::loom_bin(), " score --checkpoint ",
                                                             (root / "other_base").string(), " --tokens 1,2,3 --adapter ", step6));
  EXPECT_EQ(elsewhere.exit_code, 0) << elsewhere.output;
  EXPECT_NE(elsewhere.output.find("was trained on a base with checksum"), std::string::npos) << elsewhere.output;
}
