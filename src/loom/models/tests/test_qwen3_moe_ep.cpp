// Expert parallelism on the tiny Qwen3-MoE (8 experts, top 2, layer 0 dense) against the single
// process, 20 steps of 8 rows x 64 tokens: per-step losses within 1e-5 (relative), the gathered
// final parameters within 1e-4 (relative L2), and every selection bias bitwise equal to the single
// process's. The bias moves by +-coeff per step from the summed token counts, so an entry that
// differs means some routing decision differed: the test reports how many entries do.
// Layouts: EP 2 and EP 4 over the FSDP ranks (efsdp 1), EP 2 with FSDP over efsdp 2 (4 ranks),
// EP 2 x TP 2 (the tp ranks as the ep group; with and without FSDP), EP 2 x PP 2, EP 2 x CP 2.
#include <gtest/gtest.h>

#include "loom/train/tests/layout_runs.h"

namespace test_qwen3_moe_ep {
namespace T = loom::testing;
using loom::testing::Layout;

class Qwen3MoeExpertParallel : public ::testing::TestWithParam<Layout> {};

TEST_P(Qwen3MoeExpertParallel, TrainsLikeTheSingleProcess) {
  const Layout& l = GetParam();
  const std::string model = "--model.name=qwen3_moe";
  constexpr int kSteps = 20;
  const auto reference = T::single_process_reference(model, kSteps, true);
  ASSERT_FALSE(reference.empty());
  const auto want = T::logged_losses(reference);
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
  EXPECT_LT(want.back(), want.front());
  T::TempDir dir(l.name);
  T::RunResult r = T::run(T::loom_command(l.nproc, T::layout_train_args(dir, kSteps, l.local_batch, model + " " + l.flags + T::kSaveLast)),
                    600);
  ASSERT_EQ(r.exit_code, 0) << l.name << "\n" << r.output;
  EXPECT_NE(r.output.find("EP 2") == std::string::npos ? r.output.find("EP 4") : 0, std::string::npos)
      << "the run did not apply expert parallelism:\n" << r.output;
  const auto got = T::logged_losses(dir.path());
  ASSERT_EQ(got.size(), want.size());
  const double worst = T::worst_relative(want, got);
  EXPECT_LE(worst, 1e-5) << l.name;
  const auto want_params = T::gathered_parameters(reference, kSteps);
  const auto got_params = T::gathered_parameters(dir, kSteps);
  const double worst_param = T::worst_parameter_difference(want_params, got_params);
  EXPECT_LE(worst_param, 1e-4) << l.name;
  int64_t biases = 0, differing = 0;
  for (const auto& [name, w] : want_params) {
    if (name.find("expert_bias") == std::string::npos) continue;
    ++biases;
    ASSERT_TRUE(got_params.count(name)) << name;
    EXPECT_GT(w.abs().sum().item<double>(), 0.0) << name << " never moved";
    differing += w.ne(got_params.at(name)).sum().item<int64_t>();
  }
  EXPECT_EQ(biases, 3);
  EXPECT_EQ(differing, 0) << l.name << ": selection-bias entries that differ from the single process's";
  std::printf("%-20s %d ranks: max relative loss difference %.2e (final %.6f vs %.6f); parameters %.2e; "
              "selection-bias entries differing from the single process: %lld of %lld layers x 8\n",
              l.name, l.nproc, worst, got.back(), want.back(), worst_param, static_cast<long long>(differing),
              static_cast<long long>(biases));
}

INSTANTIATE_TEST_SUITE_P(
    EveryLayout, Qwen3MoeExpertParallel,
    ::testing::Values(
        Layout{"ep2", 2, 4, "--parallelism.expert_parallel_degree=2"},
        Layout{"ep4", 4, 2, "--parallelism.expert_parallel_degree=4"},
        Layout{"ep2_efsdp2", 4, 2, "--parallelism.expert_parallel_degree=2"},
        Layout{"ep2_tp2", 2, 8,
               "--parallelism.expert_parallel_degree=2 --parallelism.tensor_parallel_degree=2"
               " --parallelism.data_parallel_shard_degree=1"},
        Layout{"ep2_tp2_fsdp2", 4, 4, "--parallelism.expert_parallel_degree=2 --parallelism.tensor_parallel_degree=2"},
        Layout{"ep2_pp2", 4, 4,
               "--parallelism.expert_parallel_degree=2 --parallelism.pipeline_parallel_degree=2"
               " --parallelism.pipeline_parallel_schedule=1F1B --parallelism.pipeline_parallel_microbatch_size=2"},
        Layout{"ep2_cp2", 2, 8,
               "--parallelism.expert_parallel_degree=2 --parallelism.context_parallel_degree=2"
               " --parallelism.data_parallel_shard_degree=1"}),
    loom::testing::layout_test_name);

}  // namespace test_qwen3_moe_ep
