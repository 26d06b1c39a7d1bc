// The optimizer registry (parallel/optimizer_registry.h): every optimizer a run can name, its
// refusals written once (the config check and build_optimizer both call them), its FSDP planner
// granularity, and what it builds.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "loom/core/error.h"
#include "loom/optim/adamw8bit.h"
#include "loom/parallel/optimizer_registry.h"
#include "loom/testing/errors.h"

namespace optimizer_registry_test {

using loom::parallel::optimizer_names;
using loom::parallel::optimizer_spec;
using loom::parallel::OptimizerLayout;
using loom::parallel::OptimizerRequest;

TEST(OptimizerRegistry, NamesAndUnknownName) {
  EXPECT_EQ(optimizer_names(), (std::vector<std::string_view>{"AdamW", "AdamW8bit", "Muon"}));
  for (const std::string_view name : optimizer_names()) EXPECT_EQ(optimizer_spec(name).name, name);
  loom::testing::expect_error<loom::UsageError>([] { optimizer_spec("Adam"); },
                                                {"unknown optimizer.name 'Adam'", "available: AdamW, AdamW8bit, Muon"});
}

TEST(OptimizerRegistry, RefusalsNameTheSettingAndTheFix) {
  OptimizerRequest request;
  OptimizerLayout tp;
  tp.tensor_parallel_degree = 2;
  EXPECT_FALSE(optimizer_spec("AdamW").check_layout);  // AdamW runs in every layout
  loom::testing::expect_error<loom::UsageError>(
      [&] { optimizer_spec("Muon").check_layout(request, tp); },
      {"optimizer.name = \"Muon\" does not support tensor parallelism yet", "tensor_parallel_degree = 1"});
  loom::testing::expect_error<loom::UsageError>(
      [&] { optimizer_spec("AdamW8bit").check_layout(request, tp); },
      {"optimizer.name = \"AdamW8bit\" does not support tensor parallelism yet"});
  OptimizerLayout gpu;
  gpu.device = "cuda:0";
  loom::testing::expect_error<loom::UsageError>([&] { optimizer_spec("AdamW8bit").check_layout(request, gpu); },
                                                {"runs on the CPU only", "training.device = \"cpu\""});
  OptimizerLayout half;
  half.half_precision_shards = true;
  request.block_size = 260;  // a multiple of 4, not of 8
  optimizer_spec("AdamW8bit").check_layout(request, OptimizerLayout{});
  loom::testing::expect_error<loom::UsageError>([&] { optimizer_spec("AdamW8bit").check_layout(request, half); },
                                                {"optimizer.block_size = 260 is not a positive multiple of 8"});
}

TEST(OptimizerRegistry, GranularityStepGuardAndBuild) {
  OptimizerRequest request;
  request.weight_decay = 0.1;
  EXPECT_FALSE(optimizer_spec("AdamW").fsdp_granularity);
  EXPECT_TRUE(optimizer_spec("AdamW8bit").fsdp_granularity);
  EXPECT_TRUE(optimizer_spec("Muon").fsdp_granularity);
  EXPECT_TRUE(optimizer_spec("AdamW").applies_step_guard);
  EXPECT_FALSE(optimizer_spec("Muon").applies_step_guard);
  const loom::optim::NamedTensors params = {{"layers.0.w.weight", torch::randn({64, 64})},
                                            {"norm.weight", torch::ones({64})}};
  const auto adamw = optimizer_spec("AdamW").build(params, request);
  ASSERT_NE(dynamic_cast<loom::optim::AdamW*>(adamw.get()), nullptr);
  EXPECT_TRUE(adamw->applies_step_guard());
  const auto* groups = dynamic_cast<loom::optim::AdamW*>(adamw.get());
  ASSERT_EQ(groups->param_groups().size(), 2u);  // decayed matrix, undecayed norm
  EXPECT_EQ(groups->param_groups()[0].weight_decay, 0.1);
  EXPECT_NE(dynamic_cast<loom::optim::AdamW8bit*>(optimizer_spec("AdamW8bit").build(params, request).get()), nullptr);
  EXPECT_NE(dynamic_cast<loom::optim::Muon*>(optimizer_spec("Muon").build(params, request).get()), nullptr);
}

}  // namespace optimizer_registry_test
