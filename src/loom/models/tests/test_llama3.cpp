#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>

#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/core/timer.h"
#include "loom/models/llama3/hf_adapter.h"
#include "loom/models/llama3/model.h"
#include "loom/models/common/model_dir.h"
#include "loom/testing/errors.h"
#include "loom/testing/run.h"

namespace {
namespace fs = std::filesystem;
using namespace loom::llama3;
// The shared decoder's model-directory I/O.
using loom::models::detect_model_dir_format;
using loom::models::export_hf_model_dir;
using loom::models::load_hf_model_dir;
using loom::models::load_model_dir;
using loom::models::LoadedModel;
using loom::models::ModelDirFormat;
using loom::models::read_checkpoint_model_args;
using loom::models::resolve_loom_checkpoint;
using loom::models::save_loom_checkpoint;
const loom::models::ModelSpec& llama_spec() { return loom::models::get_spec("llama3"); }

const auto kMeta = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta);

// A few-layer GQA model small enough to run in milliseconds.
ModelArgs tiny_args() {
  ModelArgs a;
  a.dim = 64;
  a.n_layers = 3;
  a.n_heads = 8;
  a.n_kv_heads = 2;
  a.vocab_size = 97;
  a.multiple_of = 32;
  a.rope_theta = 10000.0;
  a.rope_scaling = {8.0, 1.0, 4.0, 16};
  a.max_seq_len = 32;
  return a;
}

std::shared_ptr<Transformer> tiny_model(uint64_t seed = 0) {
  auto model = std::make_shared<Transformer>(tiny_args(), kMeta);
  model->to_empty(torch::kCPU);
  model->init_weights(seed);
  return model;
}

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("loom_llama3_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

TEST(Flavor, PublishedShapes) {
  const ModelArgs f8 = flavor("8B");
  EXPECT_EQ(f8.ffn_hidden_dim(), 14336);
  EXPECT_EQ(flavor("70B").ffn_hidden_dim(), 28672);
  EXPECT_EQ(flavor("405B").ffn_hidden_dim(), 53248);
  EXPECT_EQ(flavor("1B").ffn_hidden_dim(), 8192);
  EXPECT_EQ(flavor("3B").ffn_hidden_dim(), 8192);
  EXPECT_EQ(flavor("3B").n_heads, 24);
  EXPECT_EQ(flavor("1B").rope_scaling.factor, 32.0);  // Llama 3.2
  EXPECT_EQ(f8.rope_scaling.factor, 8.0);             // Llama 3.1
  const ModelArgs debug = flavor("debugmodel");
  EXPECT_EQ(debug.dim, 256);
  EXPECT_EQ(debug.n_layers, 6);
  EXPECT_EQ(debug.n_heads, 16);
  EXPECT_EQ(debug.vocab_size, 2048);
  EXPECT_EQ(debug.ffn_hidden_dim(), 768);
  EXPECT_EQ(flavor("debugmodel", 4096).vocab_size, 4096);
}

TEST(Flavor, UnknownNameIsAUsageErrorListingValidOnes) {
  try {
    flavor("7B");
    FAIL();
  } catch (const loom::UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "unknown Llama 3 flavor '7B'; valid flavors: debugmodel, tiny, 124M, 1B, 3B, 8B, 70B, 405B");
  }
}

TEST(Flavor, ModelArgsJsonRoundTripAndValidation) {
  const ModelArgs f = flavor("8B");
  const ModelArgs back = model_args_from_json(to_json(f), "test");
  EXPECT_EQ(to_json(back), to_json(f));
  nlohmann::json bad = to_json(f);
  bad["n_kv_heads"] = 5;
  EXPECT_THROW(model_args_from_json(bad, "cfg.json"), loom::UsageError);
  nlohmann::json typo = to_json(f);
  typo["n_layer"] = 3;
  EXPECT_THROW(model_args_from_json(typo, "cfg.json"), loom::UsageError);
}

TEST(Transformer, MetaBuildOf405BAllocatesNothingAndCountsParameters) {
  const int64_t rss_before = loom::memory::current_rss_bytes();
  loom::Timer timer;
  Transformer model(flavor("405B"), kMeta);
  const ParameterCounts counts = count_parameters(model);
  EXPECT_LT(timer.seconds(), 1.0);
  EXPECT_LT(loom::memory::current_rss_bytes() - rss_before, int64_t{64} << 20);
  for (const auto& p : model.named_parameters()) ASSERT_TRUE(p.tensor().is_meta()) << p.name;
  // Closed form from the shapes agrees with the built model.
  const ParameterCounts expected = count_parameters(flavor("405B"));
  EXPECT_EQ(counts.total, expected.total);
  EXPECT_EQ(counts.non_embedding, expected.non_embedding);
  // Meta's 405B: 405.85e9 with the untied head (Llama 3.1 405B is untied).
  EXPECT_NEAR(static_cast<double>(counts.total) / 1e9, 405.85, 0.01);
  EXPECT_EQ(model.named_parameters().size(), 126u * 9u + 3u);
}

TEST(Transformer, KnownParameterCountsAndFlops) {
  Transformer m8(flavor("8B"), kMeta);
  const ParameterCounts c8 = count_parameters(m8);
  EXPECT_EQ(c8.total, 8030261248);  // Llama 3.1 8B, as published
  EXPECT_EQ(c8.embedding, 128256 * 4096);
  EXPECT_NEAR(static_cast<double>(count_parameters(flavor("70B")).total) / 1e9, 70.55, 0.01);
  // 1B untied: 1.236e9 published (tied) + one more 128256 x 2048 head.
  EXPECT_EQ(count_parameters(flavor("1B")).total, 1235814400 + 128256 * 2048);
  // TorchTitan: 6 N + 12 L H d T.
  EXPECT_DOUBLE_EQ(flops_per_token(flavor("8B"), c8.non_embedding, 8192),
                   6.0 * c8.non_embedding + 12.0 * 32 * 32 * 128 * 8192);
}

TEST(Transformer, ModuleLayoutAndNames) {
  Transformer model(tiny_args(), kMeta);
  std::vector<std::string> names;
  for (const auto& p : model.named_parameters()) names.push_back(p.name);
  ASSERT_EQ(names.size(), 3u * 9u + 3u);
  EXPECT_EQ(names.front(), "tok_embeddings.weight");
  const std::vector<std::string> layer0(names.begin() + 1, names.begin() + 10);
  EXPECT_EQ(layer0, (std::vector<std::string>{
                        "layers.0.attention_norm.weight", "layers.0.attention.wq.weight",
                        "layers.0.attention.wk.weight", "layers.0.attention.wv.weight",
                        "layers.0.attention.wo.weight", "layers.0.ffn_norm.weight",
                        "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
                        "layers.0.feed_forward.w3.weight"}));
  EXPECT_EQ(names[names.size() - 2], "norm.weight");
  EXPECT_EQ(names.back(), "output.weight");
  EXPECT_EQ(model.parameter("layers.2.attention.wk.weight").sizes(),
            (std::vector<int64_t>{16, 64}));
  // The RoPE cache is a non-persistent buffer: not in the state dict.
  EXPECT_EQ(model.state_dict().size(), names.size());
  EXPECT_EQ(model.buffer("freqs").sizes(), (std::vector<int64_t>{2, 32, 8}));
}

TEST(Transformer, InitStatisticsFollowTorchTitan) {
  ModelArgs args = tiny_args();
  args.dim = 256;
  args.n_heads = 8;
  args.n_kv_heads = 8;
  args.vocab_size = 512;
  Transformer model(args, kMeta);
  model.to_empty(torch::kCPU);
  model.init_weights(1234);
  auto std_of = [&](const std::string& n) { return model.parameter(n).std().item<double>(); };
  EXPECT_NEAR(std_of("tok_embeddings.weight"), 1.0, 0.02);
  EXPECT_NEAR(std_of("layers.0.attention.wq.weight"), 0.02, 0.0005);
  EXPECT_NEAR(std_of("layers.2.feed_forward.w1.weight"), 0.02, 0.0005);
  EXPECT_NEAR(std_of("layers.0.attention.wo.weight"), 0.02 / std::sqrt(2.0), 0.0005);
  EXPECT_NEAR(std_of("layers.2.feed_forward.w2.weight"), 0.02 / std::sqrt(6.0), 0.0005);
  EXPECT_NEAR(std_of("layers.1.feed_forward.w3.weight"), 0.02 / std::sqrt(4.0), 0.0005);
  // Output: std dim^-0.5 cut at 3 sigma (a truncated normal's std is 0.9866 of sigma).
  const torch::Tensor out = model.parameter("output.weight");
  const double sigma = 1.0 / 16.0;
  EXPECT_LE(out.abs().max().item<double>(), 3 * sigma + 1e-6);
  EXPECT_NEAR(out.std().item<double>(), 0.9866 * sigma, 0.002);
  EXPECT_TRUE(torch::equal(model.parameter("layers.1.ffn_norm.weight"), torch::ones({256})));
  EXPECT_TRUE(torch::equal(model.parameter("norm.weight"), torch::ones({256})));
  // Without depth_init every layer's wo uses 0.02 / sqrt(2 n_layers).
  args.depth_init = false;
  EXPECT_DOUBLE_EQ(parameter_init(args, "layers.0.attention.wo.weight").std,
                   0.02 / std::sqrt(6.0));
  EXPECT_THROW(parameter_init(args, "layers.x.attention.wo.weight"), loom::Error);
  EXPECT_THROW(parameter_init(args, "mystery.weight"), loom::Error);
}

TEST(Transformer, InitIsDeterministicAndIndependentOfDtype) {
  auto a = tiny_model(5);
  auto b = tiny_model(5);
  auto c = tiny_model(6);
  Transformer bf16(tiny_args(), kMeta.dtype(torch::kBFloat16));
  bf16.to_empty(torch::kCPU);
  bf16.init_weights(5);
  for (const auto& p : a->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.tensor(), b->parameter(p.name))) << p.name;
    EXPECT_TRUE(torch::equal(p.tensor().to(torch::kBFloat16), bf16.parameter(p.name))) << p.name;
  }
  EXPECT_FALSE(torch::equal(a->parameter("layers.0.attention.wq.weight"),
                            c->parameter("layers.0.attention.wq.weight")));
}

TEST(Transformer, ForwardIsCausalAndBatchConsistent) {
  auto model = tiny_model();
  torch::NoGradGuard no_grad;
  const torch::Tensor tokens = torch::randint(0, 97, {2, 12}, torch::kInt64);
  const torch::Tensor logits = model->forward(tokens);
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 12, 97}));
  EXPECT_TRUE(torch::isfinite(logits).all().item<bool>());
  // Changing a later token leaves earlier logits unchanged.
  torch::Tensor changed = tokens.clone();
  changed[0][8] = (changed[0][8].item<int64_t>() + 1) % 97;
  const torch::Tensor logits2 = model->forward(changed);
  EXPECT_TRUE(torch::allclose(logits.narrow(1, 0, 8), logits2.narrow(1, 0, 8), 1e-5, 1e-5));
  EXPECT_FALSE(torch::allclose(logits[0][8], logits2[0][8]));
  // Each row of the batch equals running it alone.
  EXPECT_TRUE(torch::allclose(model->forward(tokens.narrow(0, 1, 1))[0], logits[1], 1e-5, 1e-5));
  EXPECT_THROW(model->forward(torch::zeros({1, 33}, torch::kInt64)), loom::Error);
}

TEST(Transformer, BackwardReachesEveryParameter) {
  auto model = tiny_model();
  const torch::Tensor tokens = torch::randint(0, 97, {2, 10}, torch::kInt64);
  const torch::Tensor logits = model->forward(tokens);
  torch::nn::functional::cross_entropy(logits.view({-1, 97}), tokens.view({-1})).backward();
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.tensor().grad().defined()) << p.name;
    EXPECT_GT(p.tensor().grad().abs().sum().item<double>(), 0.0) << p.name;
  }
}

TEST(Transformer, BlockHooksSeeEveryLayer) {
  auto model = tiny_model();
  std::vector<int64_t> seen;
  std::vector<loom::nn::HookHandle> handles;
  for (const auto& [name, layer] : model->layers().named_children()) {
    handles.push_back(layer->add_forward_pre_hook([&seen](loom::nn::Module& m, torch::Tensor x) {
      seen.push_back(static_cast<TransformerBlock&>(m).layer_id());
      return x;
    }));
  }
  torch::NoGradGuard no_grad;
  model->forward(torch::zeros({1, 4}, torch::kInt64));
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2}));
  for (auto& h : handles) h.remove();
}

TEST(HfAdapter, NameMappingRoundTrips) {
  auto model = tiny_model();
  for (const auto& p : model->named_parameters()) {
    const auto hf = loom_to_hf_name(p.name);
    ASSERT_TRUE(hf.has_value()) << p.name;
    EXPECT_EQ(hf_to_loom_name(*hf), p.name);
  }
  EXPECT_EQ(loom_to_hf_name("layers.11.feed_forward.w1.weight"),
            "model.layers.11.mlp.gate_proj.weight");
  EXPECT_EQ(hf_to_loom_name("model.layers.3.mlp.up_proj.weight"), "layers.3.feed_forward.w3.weight");
  EXPECT_EQ(hf_to_loom_name("lm_head.weight"), "output.weight");
  EXPECT_FALSE(hf_to_loom_name("model.layers.x.mlp.up_proj.weight").has_value());
  EXPECT_TRUE(is_ignorable_hf_tensor("model.layers.0.self_attn.rotary_emb.inv_freq"));
}

TEST(HfAdapter, ReadsV4AndV5RopeConfigsAndRejectsUnsupported) {
  nlohmann::json v4 = {{"model_type", "llama"},
                       {"hidden_size", 4096},
                       {"intermediate_size", 14336},
                       {"num_hidden_layers", 32},
                       {"num_attention_heads", 32},
                       {"num_key_value_heads", 8},
                       {"vocab_size", 128256},
                       {"rms_norm_eps", 1e-5},
                       {"max_position_embeddings", 131072},
                       {"rope_theta", 500000.0},
                       {"rope_scaling",
                        {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 8192}}},
                       {"tie_word_embeddings", false}};
  const HfLlamaConfig c4 = hf_config_to_model_args(v4, "v4.json");
  EXPECT_EQ(c4.args.ffn_hidden_dim(), 14336);
  EXPECT_TRUE(c4.args.use_scaled_rope);
  EXPECT_EQ(c4.args.rope_scaling.original_max_position, 8192);
  EXPECT_EQ(count_parameters(c4.args).total, 8030261248);
  // The exported config reads back to the same arguments.
  const HfLlamaConfig again = hf_config_to_model_args(model_args_to_hf_config(c4.args, "float32"), "x");
  EXPECT_EQ(to_json(again.args), to_json(c4.args));

  nlohmann::json v5 = v4;
  v5.erase("rope_theta");
  v5.erase("rope_scaling");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  const HfLlamaConfig c5 = hf_config_to_model_args(v5, "v5.json");
  EXPECT_FALSE(c5.args.use_scaled_rope);
  EXPECT_EQ(c5.args.rope_theta, 10000.0);

  nlohmann::json yarn = v5;
  yarn["rope_parameters"]["rope_type"] = "yarn";
  EXPECT_THROW(hf_config_to_model_args(yarn, "yarn.json"), loom::Error);
  nlohmann::json bias = v4;
  bias["attention_bias"] = true;
  EXPECT_THROW(hf_config_to_model_args(bias, "bias.json"), loom::Error);
  nlohmann::json missing = v4;
  missing.erase("hidden_size");
  EXPECT_THROW(hf_config_to_model_args(missing, "missing.json"), loom::Error);
  // Issue 46 (11): a scaling factor without its type was read as no scaling at all.
  nlohmann::json untyped = v4;
  untyped["rope_scaling"] = {{"factor", 8.0}};
  loom::testing::expect_error<loom::UsageError>([&] { hf_config_to_model_args(untyped, "untyped.json"); },
                                                {"untyped.json: the rope scaling sets \"factor\" but no \"rope_type\""});
}

// Issue 46 (11): configs Loom misread without a word: no model_type (read as Llama), a DeepSeek
// scoring_func other than the two the router has (routed as softmax).
TEST(HfAdapter, ConfigsWithoutModelTypeOrWithAnUnknownScoringAreRefused) {
  TempDir tmp;
  auto model = tiny_model(6);
  export_hf_model_dir(llama_spec(), *model, tmp.path() / "hf");
  nlohmann::json config = nlohmann::json::parse(std::ifstream(tmp.path() / "hf" / "config.json"));
  config.erase("model_type");
  std::ofstream(tmp.path() / "hf" / "config.json") << config.dump();
  loom::testing::expect_error<loom::UsageError>([&] { load_model_dir(tmp.path() / "hf"); },
                                                {"has no \"model_type\"", "\"llama\""});
  const auto& deepseek = loom::models::get_spec("deepseek_v3");
  const auto args = deepseek.build_args({"tiny", 2048, 64, 0});
  nlohmann::json ds = deepseek.hf->write_config(dynamic_cast<const loom::models::DecoderArgs&>(*args), "float32");
  EXPECT_NO_THROW(deepseek.hf->read_config(ds, "ds.json"));
  ds["scoring_func"] = "softmax";
  EXPECT_NO_THROW(deepseek.hf->read_config(ds, "ds.json"));
  ds["scoring_func"] = "sparsemax";
  loom::testing::expect_error<loom::UsageError>([&] { deepseek.hf->read_config(ds, "ds.json"); },
                                                {"ds.json: scoring_func 'sparsemax' is not supported"});
}

TEST(ModelDir, LoomAndHfFormatsRoundTripExactly) {
  TempDir tmp;
  auto model = tiny_model(9);
  const torch::Tensor tokens = torch::randint(0, 97, {1, 16}, torch::kInt64);
  torch::NoGradGuard no_grad;
  const torch::Tensor expected = model->forward(tokens);

  // A model-only Loom checkpoint in the trainer's format, describing its own config.
  save_loom_checkpoint(llama_spec(), *model, tmp.path() / "loom");
  for (const char* f : {"rank-0.safetensors", "metadata.json", "COMPLETE"}) {
    EXPECT_TRUE(fs::exists(tmp.path() / "loom" / f)) << f;
  }
  EXPECT_FALSE(fs::exists(tmp.path() / "loom.saving"));
  const auto metadata = loom::checkpoint::verify_checkpoint(tmp.path() / "loom",
                                                            loom::checkpoint::Verification::kChecksums);
  EXPECT_TRUE(metadata.model_only);
  EXPECT_EQ(read_checkpoint_model_args(tmp.path() / "loom").args->summary(), model->args().summary());
  EXPECT_EQ(detect_model_dir_format(tmp.path() / "loom"), ModelDirFormat::kLoom);
  const LoadedModel loom_back = load_model_dir(tmp.path() / "loom");
  EXPECT_EQ(loom_back.format, ModelDirFormat::kLoom);
  EXPECT_TRUE(torch::equal(loom_back.model->forward(tokens), expected));
  EXPECT_THROW(save_loom_checkpoint(llama_spec(), *model, tmp.path() / "loom"), loom::UsageError);  // exists

  // A folder of step-N checkpoints stands for its newest complete one.
  fs::create_directories(tmp.path() / "run");
  fs::copy(tmp.path() / "loom", tmp.path() / "run" / "step-7");
  EXPECT_EQ(resolve_loom_checkpoint(tmp.path() / "run"), tmp.path() / "run" / "step-7");
  EXPECT_TRUE(torch::equal(load_model_dir(tmp.path() / "run").model->forward(tokens), expected));

  // Stored in bfloat16: loads back as the rounded weights.
  save_loom_checkpoint(llama_spec(), *model, tmp.path() / "bf16", torch::kBFloat16);
  const auto bf16 = load_model_dir(tmp.path() / "bf16");
  EXPECT_TRUE(torch::equal(bf16.model->output().weight(),
                           model->output().weight().to(torch::kBFloat16).to(torch::kFloat32)));

  // HF export, sharded so the index path is exercised too.
  export_hf_model_dir(llama_spec(), *model, tmp.path() / "hf", std::nullopt, /*max_shard_bytes=*/64 << 10);
  EXPECT_TRUE(fs::exists(tmp.path() / "hf" / "model.safetensors.index.json"));
  const LoadedModel hf_back = load_model_dir(tmp.path() / "hf");
  EXPECT_EQ(hf_back.format, ModelDirFormat::kHuggingFace);
  EXPECT_TRUE(torch::equal(hf_back.model->forward(tokens), expected));
  EXPECT_EQ(hf_back.model->decoder_args().summary(), model->args().summary());
}

// Issue 46 (6): a model whose file holds NaN or inf is refused at load, naming the tensor, in both
// formats (score, generate, convert and an HF initial load all go through these loaders).
TEST(ModelDir, NonFiniteWeightsAreRefusedNamingTheTensor) {
  TempDir tmp;
  auto model = tiny_model(4);
  {
    torch::NoGradGuard no_grad;
    auto w = model->parameter("layers.1.feed_forward.w2.weight");
    w.view(-1)[5] = std::numeric_limits<float>::quiet_NaN();
    w.view(-1)[9] = std::numeric_limits<float>::infinity();
  }
  save_loom_checkpoint(llama_spec(), *model, tmp.path() / "loom");
  export_hf_model_dir(llama_spec(), *model, tmp.path() / "hf");
  for (const char* dir : {"loom", "hf"}) {
    SCOPED_TRACE(dir);
    loom::testing::expect_error<loom::UsageError>(
        [&] { load_model_dir(tmp.path() / dir); },
        {"holds non-finite weights", "'layers.1.feed_forward.w2.weight' has 2 NaN/inf values", "flat index 5",
         "use an earlier checkpoint"});
  }
}

// Issue 46 (8): whatever is wrong with a model directory given as input is a usage error (exit 2:
// `loom launch --max-restarts` does not retry it), with its own message: a missing path, a missing
// tensor, a truncated shard, a config that lies about the sizes, an unknown model type.
TEST(ModelDir, EveryInconsistentDirectoryIsAUsageError) {
  TempDir tmp;
  auto model = tiny_model(5);
  export_hf_model_dir(llama_spec(), *model, tmp.path() / "hf");
  auto usage = [](const fs::path& dir, const std::string& says) {
    try {
      load_model_dir(dir);
      ADD_FAILURE() << dir << " loaded";
    } catch (const loom::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << dir << ": not a usage error: " << e.what();
    }
  };
  usage(tmp.path() / "missing", "is not a directory");
  // A truncated shard.
  fs::copy(tmp.path() / "hf", tmp.path() / "truncated", fs::copy_options::recursive);
  const fs::path shard = tmp.path() / "truncated" / "model.safetensors";
  fs::resize_file(shard, fs::file_size(shard) / 2);
  usage(tmp.path() / "truncated", "model.safetensors");
  // A config that says another vocabulary than the tensors hold.
  fs::copy(tmp.path() / "hf", tmp.path() / "lying", fs::copy_options::recursive);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(tmp.path() / "hf" / "config.json"));
  config["vocab_size"] = config["vocab_size"].get<int64_t>() + 3;
  std::ofstream(tmp.path() / "lying" / "config.json") << config.dump();
  usage(tmp.path() / "lying", "embed_tokens");
  usage(tmp.path() / "lying", "config.json does not match the weights");  // the config, not another key, is blamed
  // An unsupported model type.
  fs::copy(tmp.path() / "hf", tmp.path() / "other", fs::copy_options::recursive);
  config["vocab_size"] = config["vocab_size"].get<int64_t>() - 3;
  config["model_type"] = "mamba";
  std::ofstream(tmp.path() / "other" / "config.json") << config.dump();
  usage(tmp.path() / "other", "mamba");
}

TEST(ModelDir, TiedHfCheckpointAndMissingTensorErrors) {
  TempDir tmp;
  auto model = tiny_model(3);
  // A tied checkpoint: no lm_head.weight, tie_word_embeddings true.
  loom::checkpoint::NamedTensors tensors;
  for (auto& [name, t] : model->state_dict()) {
    if (name != "output.weight") tensors.emplace_back(*loom_to_hf_name(name), t);
  }
  fs::create_directories(tmp.path() / "tied");
  loom::checkpoint::save_safetensors(tmp.path() / "tied" / "model.safetensors", tensors);
  nlohmann::json config = model_args_to_hf_config(model->args(), "float32");
  config["tie_word_embeddings"] = true;
  std::ofstream(tmp.path() / "tied" / "config.json") << config.dump();
  auto tied = load_hf_model_dir(tmp.path() / "tied").model;
  EXPECT_TRUE(torch::equal(tied->parameter("output.weight"),
                           model->parameter("tok_embeddings.weight")));
  // Same files but untied: the missing head is named.
  config["tie_word_embeddings"] = false;
  std::ofstream(tmp.path() / "tied" / "config.json") << config.dump();
  EXPECT_THROW(load_hf_model_dir(tmp.path() / "tied"), loom::Error);

  // A missing layer tensor is named in the HF spelling.
  tensors.erase(tensors.begin() + 3);
  fs::create_directories(tmp.path() / "holes");
  loom::checkpoint::save_safetensors(tmp.path() / "holes" / "model.safetensors", tensors);
  config["tie_word_embeddings"] = true;
  std::ofstream(tmp.path() / "holes" / "config.json") << config.dump();
  try {
    load_hf_model_dir(tmp.path() / "holes");
    FAIL();
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.self_attn.k_proj.weight"),
              std::string::npos)
        << e.what();
  }
  // A directory without config.json.
  EXPECT_THROW(detect_model_dir_format(tmp.path()), loom::Error);
}

}  // namespace

namespace {

// Issue 8 K: `loom info --help` listed flavors from a hand-written string that lacked 124M. Now
// every registered model's flavors, from the registry.
TEST(InfoCli, HelpListsEveryFlavor) {
  const auto r = loom::testing::run(loom::testing::loom_bin() + " info --help", 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const size_t flag = r.output.find("--flavor");
  ASSERT_NE(flag, std::string::npos) << r.output;
  const std::string text = r.output.substr(flag, r.output.find("\n  --checkpoint", flag) - flag);
  for (const std::string_view model : loom::models::spec_names()) {
    const size_t at = text.find(std::string(model) + ":");
    ASSERT_NE(at, std::string::npos) << model << " missing from: " << text;
    const std::string listed = text.substr(at, text.find(';', at) - at);
    for (const std::string& name : loom::models::get_spec(std::string(model)).flavors) {
      EXPECT_NE(listed.find(" " + name), std::string::npos) << name << " missing from: " << listed;
    }
  }
}

}  // namespace
