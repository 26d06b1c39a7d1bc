// LoRA training (lora/, issue 27's first part): the tiny Llama with rank-4 adapters on q, v, o and
// down. Before any update the adapted model is the base (step 1's loss bitwise the full model's);
// after 20 steps the base weights are bitwise those it started from; FSDP 2 and TP 2 train like one
// process (per-step losses within 1e-5); optimizer state exists only for the adapters (bytes
// against full fine-tuning reported); a run on a base from a file saves adapter-only checkpoints and
// resumes from them; bad settings are one-line errors.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/checkpoint/metadata.h"
#include "loom/train/tests/layout_runs.h"

namespace test_trainer_lora {
namespace T = loom::testing;

// The adapters' gradient norm is ~0.012 on the tiny model (B starts at zero): clipping at 0.011
// engages on most steps, as the layout tests want (layout_runs.h).
const std::string kLora =
    " --lora.rank=4 --lora.alpha=8 --lora.target_modules=q_proj,v_proj,o_proj,down_proj --training.max_norm=0.011";

double optimizer_gib(const std::filesystem::path& dir) {
  const auto rows = T::read_jsonl(dir / "metrics.jsonl");
  return rows.empty() || !rows.back().contains("mem_optimizer_gib") ? -1.0 : rows.back()["mem_optimizer_gib"].get<double>();
}

TEST(TrainerLoRA, StartsAsTheBaseKeepsItFrozenAndTrainsLikeOneProcess) {
  constexpr int kSteps = 20;
  // One process: the full model and LoRA from the same seed.
  const auto full = T::single_process_reference("", kSteps, false);
  const auto lora = T::single_process_reference(kLora, kSteps, true);
  ASSERT_FALSE(full.empty());
  ASSERT_FALSE(lora.empty());
  const auto full_losses = T::logged_losses(full), lora_losses = T::logged_losses(lora);
  ASSERT_EQ(lora_losses.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(lora_losses[0], full_losses[0]) << "step 1 (before any update) must be the base model's, bitwise";
  EXPECT_LT(lora_losses.back(), lora_losses.front()) << "the adapters learn";
  // The base after 20 steps equals the base after 1 (both never moved from the initialization).
  T::TempDir one("lora_one_step");
  auto r = T::run(T::loom_command(1, T::layout_train_args(one, 1, 8, kLora + " --parallelism.data_parallel_shard_degree=1" +
                                                                         T::kSaveLast)),
                  300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto start = T::gathered_parameters(one, 1), end = T::gathered_parameters(lora, kSteps);
  int64_t base = 0, adapters = 0;
  for (const auto& [name, value] : end) {
    if (name.find(".lora.") != std::string::npos) {
      ++adapters;
      continue;
    }
    ++base;
    EXPECT_TRUE(torch::equal(value, start.at(name))) << name << " moved";
  }
  EXPECT_EQ(adapters, 4 * 4 * 2);  // 4 layers x 4 linears x (A, B)
  std::printf("LoRA: %lld base tensors bitwise unchanged after %d steps, %lld adapter tensors trained\n",
              static_cast<long long>(base), kSteps, static_cast<long long>(adapters));
  // FSDP 2 and TP 2 like one process; optimizer state only for the adapters.
  for (const T::Layout& l :
       {T::Layout{"lora_fsdp2", 2, 4, ""},
        T::Layout{"lora_tp2", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"}}) {
    // The base after 20 steps in the layout: bitwise the initialization (the one-step run's).
    T::expect_layout_matches_single_process(l, kLora, kSteps, {1e-5, 1e-4}, [&](const auto& parameters) {
      int64_t frozen = 0;
      for (const auto& [name, value] : parameters) {
        if (name.find(".lora.") != std::string::npos) continue;
        ++frozen;
        EXPECT_TRUE(torch::equal(value, start.at(name))) << l.name << ": " << name << " moved";
      }
      EXPECT_EQ(frozen, base) << l.name;
    });
  }
  T::TempDir fsdp_full("full_fsdp2"), fsdp_lora("lora_fsdp2_state");
  r = T::run(T::loom_command(2, T::layout_train_args(fsdp_full, 2, 4, "")), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = T::run(T::loom_command(2, T::layout_train_args(fsdp_lora, 2, 4, kLora)), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double full_state = optimizer_gib(fsdp_full.path()), lora_state = optimizer_gib(fsdp_lora.path());
  std::printf("FSDP 2 optimizer state per rank: full fine-tuning %.0f bytes, LoRA %.0f bytes (%.1fx less)\n",
              full_state * (1 << 30), lora_state * (1 << 30), full_state / lora_state);
  EXPECT_GT(full_state, 0);
  EXPECT_LT(lora_state * 20, full_state);
  // The other sharded optimizers keep no state for the frozen base either, and the frozen FSDP
  // groups hold no gradient shard.
  for (const char* optimizer : {"AdamW8bit", "Muon"}) {
    T::TempDir dir(std::string("lora_fsdp2_") + optimizer);
    r = T::run(T::loom_command(2, T::layout_train_args(dir, 2, 4, kLora + " --optimizer.name=" + optimizer)), 300);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const double state = optimizer_gib(dir.path());
    std::printf("FSDP 2 + LoRA, %s: optimizer state %.0f bytes per rank\n", optimizer, state * (1 << 30));
    EXPECT_LT(state * 20, full_state) << optimizer;
    const auto losses = T::logged_losses(dir.path());
    ASSERT_EQ(losses.size(), 2u);
    EXPECT_TRUE(std::isfinite(losses[1])) << optimizer;
  }
  const auto rows = T::read_jsonl(fsdp_lora.path() / "metrics.jsonl"), full_rows = T::read_jsonl(fsdp_full.path() / "metrics.jsonl");
  ASSERT_TRUE(rows.back().contains("mem_grads_gib")) << rows.back().dump();
  const double lora_grads = rows.back()["mem_grads_gib"], full_grads = full_rows.back()["mem_grads_gib"];
  std::printf("FSDP 2 gradient shards per rank: full fine-tuning %.0f bytes, LoRA %.0f bytes\n", full_grads * (1 << 30),
              lora_grads * (1 << 30));
  EXPECT_LT(lora_grads * 20, full_grads);
}

// A LoRA run on a base from checkpoint.initial_load_path saves adapter-only checkpoints (the base
// referenced by path and checksum), resumes from them exactly, and refuses to resume on another base.
TEST(TrainerLoRA, AdapterCheckpointsReferenceTheBaseAndResume) {
  namespace fs = std::filesystem;
  T::TempDir base("lora_base"), other_base("lora_other_base"), whole("lora_whole"), resumed("lora_resumed");
  const std::string base_flags = " --parallelism.data_parallel_shard_degree=1 --checkpoint.model_only=true" + T::kSaveLast;
  auto r = T::run(T::loom_command(1, T::layout_train_args(base, 2, 8, base_flags)), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = T::run(T::loom_command(1, T::layout_train_args(other_base, 2, 8, base_flags + " --training.seed=1")), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path base_dir = base.path() / "checkpoint" / "step-2";
  const std::string lora = kLora + " --checkpoint.enable=true --checkpoint.interval=3 --checkpoint.initial_load_path=";
  // FSDP 2, uninterrupted.
  r = T::run(T::loom_command(2, T::layout_train_args(whole, 6, 4, lora + base_dir.string())), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path step3 = whole.path() / "checkpoint" / "step-3";
  const auto meta = loom::checkpoint::CheckpointMetadata::read(step3);
  int64_t adapters = 0;
  for (const auto& [name, t] : meta.tensors) {
    if (t.component != "model") continue;
    EXPECT_NE(name.find(".lora."), std::string::npos) << name << ": a base weight in an adapter checkpoint";
    ++adapters;
  }
  EXPECT_EQ(adapters, 4 * 4 * 2);
  ASSERT_TRUE(meta.json.contains("base")) << meta.json.dump();
  EXPECT_EQ(meta.json["base"]["path"], fs::absolute(base_dir).lexically_normal().string());
  EXPECT_EQ(meta.json["base"]["checksum"].get<std::string>().rfind("crc32c:", 0), 0u);
  EXPECT_EQ(meta.json["lora"]["rank"], 4);
  const auto bytes = [](const fs::path& dir) {
    uintmax_t total = 0;
    for (const auto& f : fs::directory_iterator(dir)) total += f.file_size();
    return total;
  };
  std::printf("adapter checkpoint (adapters + their AdamW state): %ju bytes; the base (model only): %ju bytes\n",
              bytes(step3), bytes(base_dir));
  // Killed after step 3 (its checkpoint saved) and started again: steps 4-6 as the uninterrupted
  // run's, bitwise.
  r = T::run("env LOOM_FAULT_KILL=1:3 " + T::loom_command(2, T::layout_train_args(resumed, 6, 4, lora + base_dir.string())),
             300);
  ASSERT_NE(r.exit_code, 0) << r.output;
  r = T::run(T::loom_command(2, T::layout_train_args(resumed, 6, 4, lora + base_dir.string())), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  // metrics.jsonl holds both attempts' steps: the last three are the resumed ones.
  const auto want = T::logged_losses(whole.path()), got = T::logged_losses(resumed.path());
  ASSERT_EQ(want.size(), 6u);
  ASSERT_GE(got.size(), 6u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(got[got.size() - 3 + i], want[3 + i]) << "step " << i + 4 << " after the resume";
  // Resuming the same checkpoints on another base is refused before any step.
  r = T::run(T::loom_command(1, T::layout_train_args(resumed, 9, 8,
                                                     lora + (other_base.path() / "checkpoint" / "step-2").string() +
                                                         " --parallelism.data_parallel_shard_degree=1")),
             300);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("trained adapters on the base"), std::string::npos) << r.output;
  // Issue 46 (1): other adapter settings are refused in one line (exit 2) rather than rescaling the
  // trained adapters or dropping a target's from later checkpoints; a dropout change resumes.
  const std::string same_base = lora + base_dir.string() + " --parallelism.data_parallel_shard_degree=1";
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {" --lora.alpha=16", "lora.alpha = 8 (scaling 2), not lora.alpha = 16 (scaling 4"},
           {" --lora.use_rslora=true", "not lora.alpha = 8 with use_rslora"},
           {" --lora.target_modules=q_proj,v_proj,o_proj", "lora.target_modules = \"down_proj,o_proj,q_proj,v_proj\""},
           {" --lora.rank=8", "lora.rank = 4, not 8"}}) {
    SCOPED_TRACE(flags);
    r = T::run(T::loom_command(1, T::layout_train_args(resumed, 9, 8, same_base + flags)), 300);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("resume with the settings it was trained with"), std::string::npos) << r.output;
  }
  r = T::run(T::loom_command(1, T::layout_train_args(resumed, 7, 8, same_base + " --lora.dropout=0.05")), 300);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
}

TEST(TrainerLoRA, BadSettingsAreOneLine) {
  struct Case {
    std::string flags;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {" --lora.rank=4 --lora.target_modules=q_proj,qkv_proj", "lora.target_modules names 'qkv_proj', which is no linear"},
      {" --lora.rank=-1", "lora.rank"},
      {" --lora.rank=4 --lora.dropout=0.1 --activation_checkpoint.mode=full", "does not compose with activation"},
  };
  T::TempDir dir("lora_bad");
  for (const Case& c : cases) {
    const auto r = T::run(T::loom_command(1, T::layout_train_args(dir, 2, 8, c.flags + " --parallelism.data_parallel_shard_degree=1")), 120);
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.flags << "\n" << r.output;
    const size_t at = r.output.find("error:");
    std::printf("%s\n  -> %s\n", c.flags.c_str(),
                at == std::string::npos ? "(no error line)" : r.output.substr(at, r.output.find('\n', at) - at).c_str());
  }
}

}  // namespace test_trainer_lora

namespace test_trainer_lora {

// Issue 46 (2): LoRA on an MoE base leaves the base's selection (routing) biases as loaded: they
// belong to the frozen base, which PEFT exports and restores without them and which several
// adapters scored over one base share. The loads are still measured; without LoRA they move.
TEST(TrainerLoRA, MoeBaseSelectionBiasesStayFrozen) {
  T::TempDir lora_run("lora_moe"), full_run("full_moe");
  const std::string moe = " --model.name=qwen3_moe --parallelism.data_parallel_shard_degree=1" + T::kSaveLast;
  auto r = T::run(T::loom_command(1, T::layout_train_args(lora_run, 3, 8, moe + kLora)), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("selection biases frozen with the base"), std::string::npos) << r.output;
  r = T::run(T::loom_command(1, T::layout_train_args(full_run, 3, 8, moe)), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  int biases = 0;
  const auto lora_params = T::gathered_parameters(lora_run, 3), full_params = T::gathered_parameters(full_run, 3);
  for (const auto& [name, value] : lora_params) {
    if (name.find("expert_bias") == std::string::npos) continue;
    ++biases;
    EXPECT_EQ(value.abs().sum().item<double>(), 0.0) << name << " moved under LoRA";
    EXPECT_GT(full_params.at(name).abs().sum().item<double>(), 0.0) << name << " never moved in full training";
  }
  EXPECT_EQ(biases, 3);
}

}  // namespace test_trainer_lora
