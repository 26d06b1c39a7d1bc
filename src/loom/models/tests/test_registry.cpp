// The model registry and the llama3 spec: what the Trainer reaches models through.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/models/llama3/model.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/spec.h"
#include "loom/models/spec.h"
#include "loom/testing/errors.h"

namespace {
using namespace loom;

const auto kOnMeta = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta);

TEST(ModelRegistry, LooksUpRegisteredModelsByName) {
  EXPECT_EQ(models::spec_names(), (std::vector<std::string_view>{"llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss"}));
  const models::ModelSpec& spec = models::get_spec("llama3");
  EXPECT_EQ(spec.name, "llama3");
  EXPECT_EQ(spec.flavors, llama3::flavor_names());
  EXPECT_EQ(&models::get_spec("llama3"), &spec);  // one registered object, not a copy per lookup
  // Every slot the Trainer calls is filled.
  EXPECT_TRUE(spec.build_args && spec.build_model && spec.count_parameters && spec.flops_per_token &&
              spec.validate_layout && spec.parallelize && spec.model_config_json &&
              spec.model_args_from_config_json && spec.read_initial_weights);
}

TEST(ModelRegistry, UnknownNameIsAOneLineUsageErrorListingTheRegisteredOnes) {
  loom::testing::expect_error<UsageError>([] { models::get_spec("gpt2"); },
                                    {"unknown model.name 'gpt2'; available: llama3, qwen3, qwen3_moe, deepseek_v3"});
}

TEST(Llama3Spec, BuildsTheDebugFlavorWithLlama3sCounts) {
  const models::ModelSpec& spec = models::get_spec("llama3");
  const auto args = spec.build_args({"debugmodel", /*vocab_size=*/2000, /*seq_len=*/16384});
  const llama3::ModelArgs& a = llama3::args_of(*args);
  EXPECT_EQ(a.vocab_size, 2000);
  EXPECT_EQ(a.max_seq_len, 16384);  // raised to cover the training sequence
  EXPECT_EQ(a.dim, llama3::flavor("debugmodel").dim);
  EXPECT_EQ(args->summary(), a.summary());

  const std::shared_ptr<nn::Module> model = spec.build_model(*args, kOnMeta);
  auto* transformer = dynamic_cast<llama3::Transformer*>(model.get());
  ASSERT_NE(transformer, nullptr);
  for (const auto& p : model->named_parameters()) ASSERT_TRUE(p.tensor().is_meta()) << p.name;
  const models::ParameterCounts counts = spec.count_parameters(*args);
  const llama3::ParameterCounts built = llama3::count_parameters(*transformer);
  EXPECT_EQ(counts.total, built.total);
  EXPECT_EQ(counts.embedding, built.embedding);
  EXPECT_EQ(counts.non_embedding, built.non_embedding);
  EXPECT_DOUBLE_EQ(spec.flops_per_token(*args, 2048), llama3::flops_per_token(a, built.non_embedding, 2048));
}

TEST(Llama3Spec, UnknownFlavorIsAUsageError) {
  loom::testing::expect_error<UsageError>(
      [] { models::get_spec("llama3").build_args({"7B", 2048, 128}); },
      {"unknown Llama 3 flavor '7B'"});
}

TEST(Llama3Spec, ValidateLayoutIsTheTensorParallelCheck) {
  const models::ModelSpec& spec = models::get_spec("llama3");
  const auto args = spec.build_args({"debugmodel", 2048, 128});
  // debugmodel: 16 heads, 16 kv heads: TP 2 splits them, TP 3 does not.
  spec.validate_layout(*args, distributed::ParallelDims({1, 1, 1, 2, 1}, 2, 0), 128, {}, {});
  loom::testing::expect_error<UsageError>(
      [&] { spec.validate_layout(*args, distributed::ParallelDims({1, 1, 1, 3, 1}, 3, 0), 128, {}, {}); },
      {"tensor_parallel_degree"});
}

TEST(Llama3Spec, CheckpointModelConfigRoundTripsAndRefusesAnotherModel) {
  const models::ModelSpec& spec = models::get_spec("llama3");
  const auto args = spec.build_args({"debugmodel", 2048, 128});
  const nlohmann::json entry = spec.model_config_json(*args);
  EXPECT_EQ(entry.at("name"), "llama3");
  const auto back = spec.model_args_from_config_json(entry, "metadata.json");
  EXPECT_EQ(llama3::to_json(llama3::args_of(*back)), llama3::to_json(llama3::args_of(*args)));
  nlohmann::json other = entry;
  other["name"] = "gpt2";
  loom::testing::expect_error([&] { spec.model_args_from_config_json(other, "metadata.json"); },
                        {"'metadata.json' holds a 'gpt2' model"});
}

}  // namespace
