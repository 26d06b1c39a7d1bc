// Many policies over one base (rl/policies.h): a `loom rl` job of two policies equals two
// one-policy jobs seeded as its policies are, step for step (reward, loss, gradient norm), with the
// rollouts of both decoded in one batch through per-row adapters and the updates separate
// (updates_per_rollout 2 so the ratio leaves 1, a KL to the base, clipping of the gradient norm
// that engages); and the per-row adapters alone give each row its own policy's logits.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "loom/core/build_paths.h"
#include "loom/core/error.h"
#include "loom/data/tokenizer.h"
#include "loom/lora/lora.h"
#include "loom/models/common/model_dir.h"
#include "loom/models/llama3/model.h"
#include "loom/nn/layers.h"
#include "loom/models/spec.h"
#include "loom/rl/policies.h"
#include "loom/rl/rl_cli.h"
#include "loom/rl/rollout.h"
#include "loom/testing/errors.h"

namespace {
using namespace loom;
namespace fs = std::filesystem;

const fs::path kTokenizer = fs::path(loom::kSourceDir) / "data" / "default" / "tokenizer.json";

llama3::ModelArgs policies_test_args(int64_t vocab) {
  llama3::ModelArgs a;
  a.dim = 64, a.n_layers = 2, a.n_heads = 4, a.n_kv_heads = 2, a.vocab_size = vocab;
  a.multiple_of = 32, a.max_seq_len = 64, a.rope_theta = 10000.0;
  return a;
}

lora::HfModuleName attention_names() {
  return [](const std::string& path) -> std::optional<std::string> {
    const std::string tail = path.substr(path.rfind('.') + 1);
    if (tail == "wq") return std::string("q_proj");
    if (tail == "wv") return std::string("v_proj");
    return std::nullopt;
  };
}

// Per-step metrics of one policy from a metrics.jsonl ("" = the lines without a policy field).
std::vector<nlohmann::json> policy_lines(const fs::path& metrics, const std::string& policy) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("policy", std::string()) == policy) out.push_back(j);
  }
  return out;
}
}  // namespace

// Two policies' adapters stacked per row: each row's logits equal its policy's alone (bound on
// the ordinary LoRA path), with rows of both policies interleaved and a row subset.
TEST(RlPolicies, RowAdaptersGiveEachRowItsPolicysLogits) {
  auto model = std::make_shared<llama3::Transformer>(policies_test_args(97));
  model->init_weights(4);
  lora::LoRAOptions o;
  o.rank = 4;
  o.target_modules = {"q_proj", "v_proj"};
  lora::apply_lora(*model, o, attention_names());
  model->eval();
  rl::PolicySet policies(*model, 3);
  for (int64_t k = 0; k < 3; ++k) {
    policies.bind(k);
    torch::manual_seed(10 + k);
    rl::init_adapters(*model, static_cast<uint64_t>(10 + k));
    torch::NoGradGuard no_grad;
    for (const torch::Tensor& t : policies.parameters(k)) t.normal_(0.0, 0.1);
  }
  const torch::Tensor ids = torch::randint(0, 97, {4, 6}, torch::kInt64);
  torch::InferenceMode inference;
  std::vector<torch::Tensor> alone;
  for (int64_t k = 0; k < 3; ++k) {
    policies.bind(k);
    alone.push_back(model->forward(ids));
  }
  const std::vector<int64_t> policy_of_row = {2, 0, 1, 0};
  rl::PolicySet::RowAdapters rows(policies, policy_of_row, o.scaling());
  const torch::Tensor together = model->forward(ids);
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_TRUE(torch::allclose(together[r], alone[static_cast<size_t>(policy_of_row[r])][r], 1e-5, 1e-5)) << r;
  }
  rows.set_rows({1, 2});
  const torch::Tensor subset = model->forward(ids.index_select(0, torch::tensor({1, 2}, torch::kInt64)));
  EXPECT_TRUE(torch::allclose(subset[0], alone[0][1], 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(subset[1], alone[1][2], 1e-5, 1e-5));
  // A linear fed the rows' tokens flattened row by row (an MoE's shared experts) adds the same.
  rows.set_rows({0, 1, 2, 3});
  auto* wq = dynamic_cast<nn::Linear*>(model->find_submodule("layers.0.attention.wq"));
  ASSERT_NE(wq, nullptr);
  const torch::Tensor x = torch::randn({4, 6, 64});
  const torch::Tensor by_row = wq->forward(x);
  EXPECT_TRUE(torch::allclose(wq->forward(x.reshape({24, 64})), by_row.reshape({24, -1}), 1e-6, 1e-6));
  // The policies really differ (else the comparison proves nothing).
  EXPECT_GT((alone[0] - alone[1]).abs().max().item<double>(), 1e-3);
}

TEST(RlPolicies, TwoPoliciesInOneJobEqualTwoOnePolicyJobs) {
  const fs::path root = fs::temp_directory_path() / "loom_rl_policies_test";
  fs::remove_all(root);
  fs::create_directories(root);
  const data::Tokenizer tokenizer = data::Tokenizer::from_file(kTokenizer.string());
  auto model = std::make_shared<llama3::Transformer>(policies_test_args(tokenizer.vocab_size()));
  model->init_weights(2);
  models::export_hf_model_dir(models::get_spec("llama3"), *model, root / "base");
  {
    std::ofstream prompts(root / "prompts.jsonl");
    for (const char* p : {"2+3=", "10+41=", "7=", "1+1+1+1="}) prompts << nlohmann::json({{"prompt", p}, {"answer", "5"}}).dump() << "\n";
  }
  // A reward that varies with the completion (its JSON line's length mod 4), so advantages and
  // gradients are not zero.
  const auto write = [&](const std::string& name, int64_t seed, const std::string& policies) {
    const fs::path path = root / (name + ".toml");
    std::ofstream(path) << "[job]\ndump_folder = \"" << (root / name).string() << "\"\n"
                        << "[model]\nname = \"llama3\"\nflavor = \"debugmodel\"\ntokenizer_path = \"" << kTokenizer.string()
                        << "\"\nvocab_size = 0\n"
                        << "[optimizer]\nlr = 0.01\nweight_decay = 0.01\n"
                        << "[training]\nsteps = 3\nseed = " << seed << "\nmax_norm = 0.01\n"
                        << "[lora]\nrank = 4\nalpha = 8.0\ntarget_modules = \"q_proj,v_proj,gate_proj\"\n"
                        << "[checkpoint]\ninitial_load_path = \"" << (root / "base").string() << "\"\n"
                        << "[rl]\nprompts = \"" << (root / "prompts.jsonl").string() << "\"\n"
                        << "prompts_per_step = 2\ngroup_size = 3\nmax_new_tokens = 5\ntemperature = 1.2\n"
                        << "reward = \"command\"\nreward_command = \"awk '{ print length($0) % 4 }'\"\n"
                        << "kl_beta = 0.05\nupdates_per_rollout = 2\n"
                        << (policies.empty() ? std::string() : "policies = \"" + policies + "\"\n");
    return path.string();
  };
  rl::run_rl(write("both", 5, "alpha,beta"));
  rl::run_rl(write("alpha", 5, ""));
  rl::run_rl(write("beta", 6, ""));
  int compared = 0, clipped = 0;
  double worst = 0;
  for (const std::string name : {"alpha", "beta"}) {
    const auto together = policy_lines(root / "both" / "metrics.jsonl", name);
    const auto alone = policy_lines(root / name / "metrics.jsonl", "");
    ASSERT_EQ(together.size(), 3u);
    ASSERT_EQ(alone.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      for (const char* key : {"reward", "loss", "grad_norm", "kl", "completion_tokens"}) {
        const double a = together[i][key].get<double>(), b = alone[i][key].get<double>();
        worst = std::max(worst, std::abs(a - b));
        EXPECT_NEAR(a, b, 1e-5) << name << " step " << i + 1 << " " << key;
        ++compared;
      }
      clipped += alone[i]["grad_norm"].get<double>() > 0.01;
    }
    // Each policy's revision in its own folder.
    EXPECT_TRUE(fs::exists(root / "both" / "adapters" / name / "step-3" / "adapter_config.json")) << name;
  }
  EXPECT_TRUE(fs::exists(root / "alpha" / "adapters" / "step-3" / "adapter_config.json"));
  EXPECT_GE(clipped, 3);  // the gradient-norm clipping engaged
  // The two policies did not train alike (else "separate" proves nothing).
  const auto a = policy_lines(root / "both" / "metrics.jsonl", "alpha");
  const auto b = policy_lines(root / "both" / "metrics.jsonl", "beta");
  EXPECT_NE(a[0]["loss"].get<double>(), b[0]["loss"].get<double>());
  std::printf("2 policies in one job vs 2 one-policy jobs: %d figures compared, max difference %.2e\n", compared, worst);
  fs::remove_all(root);
}

TEST(RlPolicies, PolicyNamesAreChecked) {
  const fs::path path = fs::temp_directory_path() / "rl_policies_names.toml";
  const auto write = [&](const std::string& policies) {
    std::ofstream(path) << "[model]\nname = \"llama3\"\nflavor = \"debugmodel\"\n[lora]\nrank = 4\n[rl]\nprompts = \"p.jsonl\"\n"
                        << "policies = \"" << policies << "\"\n";
    return path.string();
  };
  EXPECT_EQ(rl::split_policy_names(rl::load_rl_config(write("a, b,c")).second.policies),
            (std::vector<std::string>{"a", "b", "c"}));
  loom::testing::expect_error<UsageError>([&] { rl::load_rl_config(write("a,a")); }, {"rl.policies", "all different"});
  loom::testing::expect_error<UsageError>([&] { rl::load_rl_config(write("a,../x")); }, {"rl.policies", "letters"});
  loom::testing::expect_error<UsageError>([&] { rl::load_rl_config(write("a,,b")); }, {"rl.policies"});
  setenv("WORLD_SIZE", "2", 1);
  loom::testing::expect_error<UsageError>([&] { rl::load_rl_config(write("a,b")); }, {"rl.policies", "one process"});
  EXPECT_NO_THROW(rl::load_rl_config(write("a")));
  unsetenv("WORLD_SIZE");
}
