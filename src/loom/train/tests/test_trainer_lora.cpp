// LoRA training (lora/, issue 27's first part): the tiny Llama with rank-4 adapters on q, v, o and
// down. Before any update the adapted model is the base (step 1's loss bitwise the full model's);
// after 20 steps the base weights are bitwise those it started from; FSDP 2 and TP 2 train like one
// process (per-step losses within 1e-5); optimizer state exists only for the adapters (bytes
// against full fine-tuning reported); bad settings are one-line errors.
#include <gtest/gtest.h>

#include "loom/train/tests/layout_runs.h"

namespace test_trainer_lora {
namespace T = loom::testing;

const std::string kLora = " --lora.rank=4 --lora.alpha=8 --lora.target_modules=q_proj,v_proj,o_proj,down_proj";

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
    T::expect_layout_matches_single_process(l, kLora, kSteps, {1e-5, 1e-4});
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
