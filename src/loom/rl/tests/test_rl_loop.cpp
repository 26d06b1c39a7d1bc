// `loom rl`'s pieces (issue 51): the rollout's log-probabilities against the training forward's,
// one GRPO step's adapter gradient against the analytic one, and the config's one-line refusals.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "loom/data/byte_level.h"
#include "loom/data/tokenizer.h"
#include "loom/lora/lora.h"
#include "loom/models/common/generate.h"
#include "loom/models/llama3/model.h"
#include "loom/rl/config.h"
#include "loom/rl/grpo.h"
#include "loom/rl/rl_cli.h"
#include "loom/rl/rollout.h"
#include "loom/core/build_paths.h"
#include "loom/core/error.h"
#include "loom/testing/errors.h"

namespace {
using namespace loom;

llama3::ModelArgs tiny_args() {
  llama3::ModelArgs a;
  a.dim = 64, a.n_layers = 2, a.n_heads = 8, a.n_kv_heads = 2, a.vocab_size = 97;
  a.multiple_of = 32, a.max_seq_len = 32, a.rope_theta = 10000.0;
  return a;
}

// A tiny model with LoRA adapters whose B is non-zero, so the adapters change every logit.
std::shared_ptr<llama3::Transformer> adapted_model() {
  auto model = std::make_shared<llama3::Transformer>(tiny_args());
  model->init_weights(7);
  lora::LoRAOptions o;
  o.rank = 4;
  lora::apply_lora(*model, o, [](const std::string& path) -> std::optional<std::string> {
    const std::string tail = path.substr(path.rfind('.') + 1);
    if (tail == "wq") return std::string("q_proj");
    if (tail == "wk") return std::string("k_proj");
    if (tail == "wv") return std::string("v_proj");
    if (tail == "wo") return std::string("o_proj");
    return std::nullopt;
  });
  rl::init_adapters(*model, 3);
  torch::manual_seed(3);
  torch::NoGradGuard no_grad;
  for (const auto& p : model->named_parameters()) {
    if (p.name.size() > 7 && p.name.compare(p.name.size() - 7, 7, ".lora.b") == 0) {
      p.slot->tensor.normal_(0.0, 0.05);
    }
  }
  model->eval();
  return model;
}

struct Rollouts {
  std::vector<std::vector<int64_t>> prompts;
  std::vector<rl::Completion> completions;
};

Rollouts sample(models::Decoder& model, double temperature) {
  models::SamplingOptions s;
  s.max_new_tokens = 9;
  s.temperature = temperature;
  s.stop_id = 5;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  Rollouts r;
  const std::vector<std::vector<int64_t>> prompts = {{1, 2, 3}, {4, 8, 15, 16, 23}, {42}};
  for (const auto& p : prompts) {
    for (int g = 0; g < 2; ++g) {
      r.prompts.push_back(p);
      r.completions.push_back(rl::sample_completion(model, p, s, gen));
    }
  }
  return r;
}

}  // namespace

// (a) The log-probability of each sampled token, recorded by the KV-cached rollout, equals the
// batched, right-padded training forward's within float32 rounding (at two temperatures).
TEST(RlLoop, RolloutLogprobsEqualTrainingForward) {
  auto model = adapted_model();
  for (const double temperature : {1.0, 0.7}) {
    const Rollouts r = sample(*model, temperature);
    const rl::Batch batch = rl::make_batch(r.prompts, r.completions);
    const torch::Tensor old = rl::rollout_logprobs(r.prompts, r.completions, batch);
    const torch::Tensor now = rl::token_logprobs(*model, batch, temperature);
    EXPECT_GT(batch.mask.sum().item<double>(), 6);
    EXPECT_TRUE(torch::allclose(now.detach(), old, /*rtol=*/1e-5, /*atol=*/1e-5))
        << "max diff " << (now.detach() - old).abs().max().item<double>();
    // Only completion positions count.
    EXPECT_EQ((now.detach() * (1 - batch.mask)).abs().sum().item<double>(), 0.0);
  }
}

// (a') The batched rollout: all completions of prompts of 3, 5 and 1 tokens (two each) decoded in
// one cache, each row from its own generator, give the tokens of sampling each alone with the same
// generator and log-probabilities equal within float32 rounding; the stop token is one that some
// rows sample early, so rows finish at different steps and leave the batch.
TEST(RlLoop, BatchedRolloutEqualsOneAtATime) {
  auto model = adapted_model();
  const std::vector<std::vector<int64_t>> prompts = {{1, 2, 3}, {1, 2, 3}, {4, 8, 15, 16, 23}, {4, 8, 15, 16, 23}, {42}, {42}};
  models::SamplingOptions s;
  s.max_new_tokens = 8;
  s.temperature = 1.3;
  s.top_k = 40;
  auto alone = [&](int64_t stop) {
    s.stop_id = stop;
    std::vector<rl::Completion> out;
    for (size_t i = 0; i < prompts.size(); ++i) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(rl::completion_seed(9, 1, static_cast<int64_t>(i)));
      out.push_back(rl::sample_completion(*model, prompts[i], s, gen));
    }
    return out;
  };
  // The stop token: the third token row 0 samples without one.
  const int64_t stop = alone(-1)[0].tokens[2];
  const std::vector<rl::Completion> one = alone(stop);
  std::vector<at::Generator> gens;
  for (size_t i = 0; i < prompts.size(); ++i) {
    gens.push_back(at::make_generator<at::CPUGeneratorImpl>(rl::completion_seed(9, 1, static_cast<int64_t>(i))));
  }
  std::vector<std::vector<int64_t>> seen_rows;
  const std::vector<rl::Completion> batched =
      rl::sample_completions(*model, prompts, s, gens, [&](const std::vector<int64_t>& rows) { seen_rows.push_back(rows); });
  size_t short_rows = 0, full_rows = 0;
  double worst = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(batched[i].tokens, one[i].tokens) << "row " << i;
    ASSERT_EQ(batched[i].logp.size(), one[i].logp.size());
    for (size_t j = 0; j < one[i].logp.size(); ++j) {
      worst = std::max(worst, std::abs(batched[i].logp[j] - one[i].logp[j]));
      EXPECT_NEAR(batched[i].logp[j], one[i].logp[j], 1e-5) << "row " << i << " token " << j;
    }
    (one[i].tokens.size() < static_cast<size_t>(s.max_new_tokens) ? short_rows : full_rows) += 1;
  }
  EXPECT_GE(short_rows, 1u);
  EXPECT_GE(full_rows, 1u);
  // Finished rows left the batch: the last forward computed only the rows still running.
  EXPECT_EQ(seen_rows.front().size(), prompts.size());
  EXPECT_LT(seen_rows.back().size(), prompts.size());
  std::printf("batched rollout: %zu of %zu rows stopped early, max |logp batched - alone| %.2e\n", short_rows,
              prompts.size(), worst);
}

// (b, C++ only) One GRPO step on fixed rollouts: with logp_old = the rollout's, the ratio is 1 and
// the "grpo" loss is -mean_i A_i mean_t logp_it / ... whose gradient is that of the surrogate
// -mean_i (A_i / n_i) sum_t logp_it; the adapters' gradient from grpo_loss equals the surrogate's.
TEST(RlLoop, GrpoStepGradientEqualsSurrogate) {
  auto model = adapted_model();
  const Rollouts r = sample(*model, 1.0);
  const rl::Batch batch = rl::make_batch(r.prompts, r.completions);
  const torch::Tensor old = rl::rollout_logprobs(r.prompts, r.completions, batch);
  const torch::Tensor rewards = torch::tensor({1.0f, 0.0f, 0.5f, 0.5f, 0.0f, 1.0f});
  const torch::Tensor adv = rl::group_advantages(rewards, 2);
  std::vector<torch::Tensor> trained;
  for (const auto& p : model->named_parameters()) {
    if (p.tensor().requires_grad()) trained.push_back(p.tensor());
  }
  ASSERT_FALSE(trained.empty());
  auto grads = [&](const torch::Tensor& loss) {
    for (auto& t : trained) t.mutable_grad() = torch::Tensor();
    loss.backward();
    std::vector<torch::Tensor> g;
    for (auto& t : trained) g.push_back(t.grad().clone());
    return g;
  };
  const rl::GrpoLoss loss = rl::grpo_loss(rl::token_logprobs(*model, batch, 1.0), old, {}, adv, batch.mask, {});
  EXPECT_NEAR(loss.ratio, 1.0, 1e-4);
  EXPECT_NEAR(loss.clipped_low + loss.clipped_high, 0.0, 1e-9);
  const std::vector<torch::Tensor> g1 = grads(loss.loss);
  const torch::Tensor logp = rl::token_logprobs(*model, batch, 1.0);
  const torch::Tensor surrogate = -(adv * logp.sum(1) / batch.mask.sum(1)).mean();
  const std::vector<torch::Tensor> g2 = grads(surrogate);
  double norm = 0;
  for (size_t i = 0; i < g1.size(); ++i) {
    EXPECT_TRUE(torch::allclose(g1[i], g2[i], 1e-4, 1e-6)) << i;
    norm += g1[i].pow(2).sum().item<double>();
  }
  EXPECT_GT(norm, 0.0);
}

namespace {
std::string write_config(const std::string& name, const std::string& rl_table) {
  const std::string path = (std::filesystem::temp_directory_path() / name).string();
  std::ofstream(path) << "[model]\nname = \"llama3\"\nflavor = \"debugmodel\"\n[lora]\nrank = 4\n" << rl_table;
  return path;
}
}  // namespace

// (c) Bad input: one line each.
TEST(RlLoop, ConfigRefusals) {
  const auto configs = rl::load_rl_config(write_config("rl_ok.toml", "[rl]\nprompts = \"p.jsonl\"\ngroup_size = 3\n"));
  EXPECT_EQ(configs.second.group_size, 3);
  EXPECT_EQ(configs.first.lora.rank, 4);
  loom::testing::expect_error<UsageError>(
      [] { rl::load_rl_config(write_config("rl_g1.toml", "[rl]\nprompts = \"p.jsonl\"\ngroup_size = 1\n")); },
      {"rl.group_size", "at least 2"});
  loom::testing::expect_error<UsageError>(
      [] { rl::load_rl_config(write_config("rl_none.toml", "")); }, {"needs an [rl] section"});
  loom::testing::expect_error<UsageError>(
      [] { rl::load_rl_config(write_config("rl_typo.toml", "[rl]\nprompts = \"p\"\ngroup_sise = 2\n")); },
      {"unknown config key 'rl.group_sise'", "rl.group_size"});
  loom::testing::expect_error<UsageError>(
      [] { rl::load_rl_config(write_config("rl_cmd.toml", "[rl]\nprompts = \"p\"\nreward = \"command\"\n")); },
      {"rl.reward_command"});
  loom::testing::expect_error<UsageError>(
      [] { rl::load_rl_config(write_config("rl_enum.toml", "[rl]\nprompts = \"p\"\nreward = \"fuzzy\"\n")); },
      {"rl.reward", "fuzzy"});
  loom::testing::expect_error<UsageError>(
      [] { rl::load_rl_config(write_config("rl_temp.toml", "[rl]\nprompts = \"p\"\ntemperature = 0.0\n")); },
      {"rl.temperature"});
  loom::testing::expect_error<UsageError>(
      [] {
        rl::load_rl_config(
            write_config("rl_resume.toml", "[rl]\nprompts = \"p\"\nresume = true\nrollback = \"out/adapters/step-2\"\n"));
      },
      {"rl.rollback", "rl.resume = true"});
}

// (c) Prompt files: a prompt that leaves no room for max_new_tokens in the context, a malformed
// line, an empty file: each one line naming FILE:LINE, before any model is loaded.
TEST(RlLoop, PromptFileRefusals) {
  const std::string dir = ::testing::TempDir();
  // Byte-level BPE over the 256 bytes, no merges: a character's id is its byte.
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[data::byte_level::to_alphabet(std::string(1, static_cast<char>(b)))] = b;
  const nlohmann::json j = {{"version", "1.0"}, {"added_tokens", nlohmann::json::array()}, {"normalizer", nullptr},
                            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                            {"decoder", {{"type", "ByteLevel"}}},
                            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  const data::Tokenizer tokenizer = data::Tokenizer::from_json_string(j.dump(), "bytes");
  const auto file = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  const std::string good = file("rl_good.jsonl", "{\"prompt\": \"1+2=\", \"answer\": \"3\"}\n\n{\"prompt\": \"4+4=\", \"answer\": 8}\n");
  const std::vector<rl::Prompt> prompts = rl::read_prompts(good, tokenizer, false, 4, 32);
  ASSERT_EQ(prompts.size(), 2u);
  EXPECT_EQ(prompts[0].ids, (std::vector<int64_t>{'1', '+', '2', '='}));
  EXPECT_EQ(prompts[1].answer, "8");
  const std::string long_prompt = file("rl_long.jsonl", "{\"prompt\": \"1+2=\"}\n{\"prompt\": \"" + std::string(30, '7') + "\"}\n");
  loom::testing::expect_error<UsageError>([&] { rl::read_prompts(long_prompt, tokenizer, false, 4, 32); },
                                          {"rl_long.jsonl:2", "30", "32"});
  loom::testing::expect_error<UsageError>(
      [&] { rl::read_prompts(file("rl_bad.jsonl", "{\"prompt\": \"1\"}\nnot json\n"), tokenizer, false, 4, 32); },
      {"rl_bad.jsonl:2", "not a JSON object"});
  loom::testing::expect_error<UsageError>(
      [&] { rl::read_prompts(file("rl_noprompt.jsonl", "{\"question\": \"1\"}\n"), tokenizer, false, 4, 32); },
      {"rl_noprompt.jsonl:1", "\"prompt\""});
  loom::testing::expect_error<UsageError>([&] { rl::read_prompts(file("rl_empty.jsonl", "\n"), tokenizer, false, 4, 32); },
                                          {"holds no prompt"});
}

// Every shipped `loom rl` config (an [rl] table next to the job's sections) loads through rl's
// loader; Config.EveryShippedConfigLoads loads the others.
TEST(RlLoop, ShippedRlConfigsLoad) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(loom::kSourceDir) + "/configs")) {
    if (entry.path().extension() != ".toml") continue;
    std::ifstream in(entry.path());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.find("\n[rl]") == std::string::npos) continue;
    SCOPED_TRACE(entry.path().string());
    const auto [job, rl_config] = rl::load_rl_config(entry.path().string());
    EXPECT_FALSE(job.model.flavor.empty());
    EXPECT_GE(rl_config.group_size, 2);
    ++count;
  }
  EXPECT_GE(count, 1);
}

// docs/config.md ends with the [rl] reference `make docs` appends (`loom rl --config-reference`):
// a key added or re-described in rl_section() without `make docs` fails here.
TEST(RlLoop, ConfigReferenceIsInTheDocs) {
  std::ifstream in(std::string(loom::kSourceDir) + "/docs/config.md");
  const std::string page((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = page.find(rl::kRlReferenceMarker);
  ASSERT_NE(at, std::string::npos) << "docs/config.md has no [rl] reference: run `make docs`";
  EXPECT_EQ(page.substr(page.find('\n', at) + 1), rl::rl_reference_markdown()) << "run `make docs`";
  for (const options::Key& key : rl::rl_section().keys) {
    EXPECT_NE(page.find(c10::str("| `rl.", key.name, "` |")), std::string::npos) << key.name;
    EXPECT_FALSE(key.help.empty()) << key.name;
  }
}
