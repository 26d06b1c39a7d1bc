// Expert parallelism on the tiny Qwen3-MoE (8 experts, top 2, layer 0 dense) against the single
// process, 20 steps of 8 rows x 64 tokens: per-step losses and gradient norms (clipping engaged)
// within 1e-5 (relative), the gathered
// final parameters within 1e-4 (relative L2), and every selection bias bitwise equal to the single
// process's. The bias moves by +-coeff per step from the summed token counts, so an entry that
// differs means some routing decision differed: the test reports how many entries do.
// Layouts: EP 2 and EP 4 (with gradient accumulation) over the FSDP ranks (efsdp 1), EP 2 with FSDP
// over efsdp 2 (4 ranks),
// EP 2 x TP 2 (the tp ranks as the ep group; with and without FSDP), EP 2 x PP 2, EP 2 with HSDP
// (2 replicas), with full activation checkpointing (the recompute dispatches again), and EP 2 x CP 2.
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
  // The gradient norms, with clipping engaged on at least half the steps (layout_runs.h).
  const auto want_norms = T::logged_grad_norms(reference), got_norms = T::logged_grad_norms(dir.path());
  ASSERT_EQ(got_norms.size(), want_norms.size()) << l.name;
  EXPECT_GE(2 * T::clipped_steps(want_norms, T::effective_max_norm(model)), kSteps);
  const double worst_norm = T::worst_relative(want_norms, got_norms);
  EXPECT_LE(worst_norm, 1e-5) << l.name << ": the gradient norm differs from the single process's";
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
  std::printf("%-20s %d ranks: max relative loss difference %.2e (final %.6f vs %.6f), grad norm %.2e; parameters "
              "%.2e; selection-bias entries differing from the single process: %lld of %lld layers x 8\n",
              l.name, l.nproc, worst, got.back(), want.back(), worst_norm, worst_param, static_cast<long long>(differing),
              static_cast<long long>(biases));
}

INSTANTIATE_TEST_SUITE_P(
    EveryLayout, Qwen3MoeExpertParallel,
    ::testing::Values(
        Layout{"ep2", 2, 4, "--parallelism.expert_parallel_degree=2"},
        // EP 4 with gradient accumulation: 2 micro-batches of 1 row per rank.
        Layout{"ep4_accumulate", 4, 1, "--parallelism.expert_parallel_degree=4 --training.global_batch_size=8"},
        Layout{"ep2_efsdp2", 4, 2, "--parallelism.expert_parallel_degree=2"},
        Layout{"ep2_tp2", 2, 8,
               "--parallelism.expert_parallel_degree=2 --parallelism.tensor_parallel_degree=2"
               " --parallelism.data_parallel_shard_degree=1"},
        Layout{"ep2_tp2_fsdp2", 4, 4, "--parallelism.expert_parallel_degree=2 --parallelism.tensor_parallel_degree=2"},
        Layout{"ep2_pp2", 4, 4,
               "--parallelism.expert_parallel_degree=2 --parallelism.pipeline_parallel_degree=2"
               " --parallelism.pipeline_parallel_schedule=1F1B --parallelism.pipeline_parallel_microbatch_size=2"},
        Layout{"ep2_hsdp", 4, 2, "--parallelism.expert_parallel_degree=2 --parallelism.data_parallel_replicate_degree=2"},
        Layout{"ep2_efsdp2_ac_full", 4, 2, "--parallelism.expert_parallel_degree=2 --activation_checkpoint.mode=full"},
        Layout{"ep2_cp2", 2, 8,
               "--parallelism.expert_parallel_degree=2 --parallelism.context_parallel_degree=2"
               " --parallelism.data_parallel_shard_degree=1"}),
    loom::testing::layout_test_name);

}  // namespace test_qwen3_moe_ep

namespace test_qwen3_moe_ep {

// Checkpoints reshard experts like any tensor: saved at EP 4 (each rank its 2 experts of every
// layer), resumed at EP 2 and in one process, the steps after the resume match the uninterrupted
// EP 4 run within 1e-5.
TEST(Qwen3MoeExpertParallel, CheckpointsReshardExpertsAcrossDegrees) {
  const std::string flags = "--model.name=qwen3_moe --checkpoint.enable=true --checkpoint.interval=4";
  T::TempDir full("moe_ep4_full");
  auto r = T::run(T::loom_command(4, T::layout_train_args(full, 8, 2, flags + " --parallelism.expert_parallel_degree=4")),
                  300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto want = T::logged_losses(full.path());
  ASSERT_EQ(want.size(), 8u);
  struct Resume {
    const char* name;
    int nproc;
    std::string flags;
  };
  for (const Resume& resume : {Resume{"moe_ep4_to_ep2", 2, " --parallelism.expert_parallel_degree=2"},
                               Resume{"moe_ep4_to_single", 1, ""}}) {
    T::TempDir dir(resume.name);
    std::filesystem::create_directories(dir.path() / "checkpoint");
    std::filesystem::copy(full.path() / "checkpoint" / "step-4", dir.path() / "checkpoint" / "step-4",
                          std::filesystem::copy_options::recursive);
    r = T::run(T::loom_command(resume.nproc, T::layout_train_args(dir, 8, 8 / resume.nproc, flags + resume.flags)), 300);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto got = T::logged_losses(dir.path());
    ASSERT_EQ(got.size(), 4u) << r.output;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[4 + i]) / want[4 + i]);
    EXPECT_LE(worst, 1e-5) << resume.name;
    std::printf("EP 4 checkpoint resumed %s: steps 5-8 within %.2e of the uninterrupted run\n",
                resume.nproc == 1 ? "in one process" : "at EP 2", worst);
  }
}

// Bad expert-parallel settings: one line, exit 2, before any process group exists.
TEST(Qwen3MoeExpertParallel, BadSettingsAreOneLineBeforeRendezvous) {
  struct Case {
    int nproc;
    std::string flags;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {4, "--model.name=qwen3_moe --parallelism.expert_parallel_degree=3",
       "expert_parallel_degree 3 does not divide dp_shard 4 x cp 1 x tp 1 = 4"},
      {3, "--model.name=qwen3_moe --parallelism.expert_parallel_degree=3",
       "expert_parallel_degree 3 does not divide the 8 routed experts"},
      {2, "--parallelism.expert_parallel_degree=2", "needs a Mixture-of-Experts model"},
      {2, "--model.name=qwen3_moe --parallelism.expert_parallel_degree=2 --parallelism.tensor_parallel_degree=2"
          " --parallelism.data_parallel_shard_degree=1 --parallelism.disable_sequence_parallel=true",
       "needs sequence parallelism"},
      {4, "--model.name=qwen3_moe --parallelism.expert_parallel_degree=2 --parallelism.tensor_parallel_degree=4"
          " --parallelism.data_parallel_shard_degree=1",
       "without FSDP"},
  };
  T::TempDir dir("moe_ep_bad");
  for (const Case& c : cases) {
    const auto r = T::run(T::loom_command(c.nproc, T::layout_train_args(dir, 2, 8, c.flags)), 120);
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.flags << "\n" << r.output;
    EXPECT_EQ(r.output.find("parallelism: dp_replicate"), std::string::npos) << "got past rendezvous:\n" << r.output;
    const size_t at = r.output.find("error:");
    ASSERT_NE(at, std::string::npos) << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    std::printf("%s\n  -> %s\n", c.flags.c_str(), line.c_str());
  }
}

}  // namespace test_qwen3_moe_ep
