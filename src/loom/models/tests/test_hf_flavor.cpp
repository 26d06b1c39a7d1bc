// model.flavor = "hf": a model's shape from a Hugging Face config.json, for every registered family,
// through the family's one config reader (HfFormat::read_config, which `loom score` and `convert`
// use too); what a family cannot express is a one-line UsageError naming the field and its value.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/model_dir.h"
#include "loom/models/config.h"
#include "loom/models/spec.h"
#include "loom/testing/errors.h"
#include "loom/testing/files.h"

namespace {
using namespace loom;
using nlohmann::json;
namespace fs = std::filesystem;

// Small configs of every family in shapes no built-in flavor has (odd widths, other head counts,
// another vocabulary, other expert counts and top-k), as transformers writes them.
json llama_config() {
  return {{"model_type", "llama"},     {"hidden_size", 48},          {"intermediate_size", 100},
          {"num_hidden_layers", 3},    {"num_attention_heads", 6},   {"num_key_value_heads", 2},
          {"vocab_size", 2053},        {"rms_norm_eps", 1e-5},       {"max_position_embeddings", 256},
          {"rope_theta", 10000.0},     {"hidden_act", "silu"},       {"tie_word_embeddings", false}};
}
json qwen3_config() {
  return {{"model_type", "qwen3"},     {"hidden_size", 40},          {"intermediate_size", 72},
          {"num_hidden_layers", 2},    {"num_attention_heads", 5},   {"num_key_value_heads", 1},
          {"head_dim", 12},            {"vocab_size", 2077},         {"rms_norm_eps", 1e-6},
          {"max_position_embeddings", 128}, {"rope_theta", 1000000.0}, {"hidden_act", "silu"},
          {"tie_word_embeddings", true}, {"use_sliding_window", false},
          {"layer_types", {"full_attention", "full_attention"}}};
}
json qwen3_moe_config() {
  json c = qwen3_config();
  c["model_type"] = "qwen3_moe";
  c["tie_word_embeddings"] = false;
  c["num_experts"] = 6;
  c["num_experts_per_tok"] = 3;
  c["moe_intermediate_size"] = 20;
  c["norm_topk_prob"] = true;
  c["mlp_only_layers"] = json::array();
  c["decoder_sparse_step"] = 1;
  return c;
}
json deepseek_v3_config() {
  return {{"model_type", "deepseek_v3"}, {"hidden_size", 56},       {"intermediate_size", 96},
          {"moe_intermediate_size", 24}, {"num_hidden_layers", 3},  {"num_attention_heads", 3},
          {"num_key_value_heads", 3},    {"vocab_size", 2061},      {"first_k_dense_replace", 1},
          {"n_routed_experts", 5},       {"n_shared_experts", 1},   {"num_experts_per_tok", 2},
          {"n_group", 1},                {"topk_group", 1},         {"norm_topk_prob", true},
          {"routed_scaling_factor", 1.5}, {"scoring_func", "sigmoid"}, {"topk_method", "noaux_tc"},
          {"q_lora_rank", 0},            {"kv_lora_rank", 16},      {"qk_nope_head_dim", 8},
          {"qk_rope_head_dim", 4},       {"v_head_dim", 10},        {"rms_norm_eps", 1e-6},
          {"max_position_embeddings", 128}, {"rope_theta", 10000.0}, {"hidden_act", "silu"},
          {"tie_word_embeddings", false}};
}

json gpt_oss_config() {
  return {{"model_type", "gpt_oss"},   {"hidden_size", 48},          {"intermediate_size", 32},
          {"num_hidden_layers", 3},    {"num_attention_heads", 6},   {"num_key_value_heads", 2},
          {"head_dim", 8},             {"vocab_size", 2083},         {"rms_norm_eps", 1e-5},
          {"max_position_embeddings", 128}, {"hidden_act", "silu"},  {"tie_word_embeddings", false},
          {"num_local_experts", 6},    {"num_experts_per_tok", 3},   {"sliding_window", 5},
          {"attention_bias", true},
          {"layer_types", {"full_attention", "sliding_attention", "sliding_attention"}},
          {"rope_parameters",
           {{"rope_type", "yarn"}, {"rope_theta", 150000.0}, {"factor", 8.0}, {"beta_fast", 32.0},
            {"beta_slow", 1.0}, {"truncate", false}, {"original_max_position_embeddings", 16}}}};
}

struct Family {
  std::string name;
  std::function<json()> config;
};
const std::vector<Family>& families() {
  static const std::vector<Family> f = {{"llama3", llama_config},
                                        {"qwen3", qwen3_config},
                                        {"qwen3_moe", qwen3_moe_config},
                                        {"deepseek_v3", deepseek_v3_config},
                                        {"gpt_oss", gpt_oss_config}};
  return f;
}

fs::path write_config(const fs::path& dir, const json& config) {
  fs::create_directories(dir);
  loom::testing::write(dir / "config.json", config.dump(2));
  return dir / "config.json";
}

models::ModelRequest hf_request(const fs::path& config_json, int64_t seq_len = 64) {
  models::ModelRequest r{models::kHfFlavor, 0, seq_len, 0};
  r.hf_config = config_json;
  return r;
}

json shape_of(const models::ModelSpec& spec, const models::ModelArgs& args) {
  json j = spec.model_config_json(args);
  j["model_args"].erase("max_seq_len");
  return j;
}

TEST(HfFlavor, EveryFamilyBuildsTheShapeOfItsConfigJsonThroughItsOneReader) {
  const fs::path dir = loom::testing::temp_dir();
  for (const Family& family : families()) {
    SCOPED_TRACE(family.name);
    const models::ModelSpec& spec = models::get_spec(family.name);
    const fs::path path = write_config(dir / family.name, family.config());
    const auto args = spec.build_args(hf_request(path, /*seq_len=*/512));
    // The same reader as `loom score` / `convert` (read_model_dir_args): the same args.
    const models::ModelDirArgs read = models::read_model_dir_args(dir / family.name);
    EXPECT_EQ(read.spec, &spec);
    EXPECT_EQ(shape_of(spec, *args), shape_of(spec, *read.args));
    const auto& decoder = dynamic_cast<const models::DecoderArgs&>(*args);
    EXPECT_EQ(decoder.vocab_size, family.config()["vocab_size"].get<int64_t>());
    EXPECT_EQ(decoder.n_layers, family.config()["num_hidden_layers"].get<int64_t>());
    EXPECT_EQ(decoder.dim, family.config()["hidden_size"].get<int64_t>());
    EXPECT_EQ(decoder.max_seq_len, 512);  // the RoPE table covers training.seq_len
    // A shape of its own: no built-in flavor has it, whatever its vocabulary and depth.
    json own = shape_of(spec, *args)["model_args"];
    own.erase("n_layers");
    for (const std::string& flavor : spec.flavors) {
      json built = shape_of(spec, *spec.build_args({flavor, decoder.vocab_size, 64}))["model_args"];
      built.erase("n_layers");
      EXPECT_NE(built, own) << flavor;
    }
    // The checkpoint entry round-trips to the same shape (what a resume compares).
    const auto back = spec.model_args_from_config_json(spec.model_config_json(*args), "test");
    EXPECT_EQ(spec.model_config_json(*back), spec.model_config_json(*args));
  }
  // The shapes that matter, spelled out for two families.
  const auto moe = models::get_spec("qwen3_moe").build_args(hf_request(dir / "qwen3_moe" / "config.json"));
  EXPECT_EQ(models::get_spec("qwen3_moe").model_config_json(*moe)["model_args"]["n_experts"], 6);
  EXPECT_EQ(models::get_spec("qwen3_moe").model_config_json(*moe)["model_args"]["top_k"], 3);
  EXPECT_EQ(dynamic_cast<const models::DecoderArgs&>(*moe).routed_experts(), 6);
  const auto qwen = models::get_spec("qwen3").build_args(hf_request(dir / "qwen3" / "config.json"));
  const auto& q = dynamic_cast<const models::DecoderArgs&>(*qwen);
  EXPECT_EQ(q.head_dim(), 12);
  EXPECT_EQ(q.n_heads, 5);
  EXPECT_EQ(q.n_kv_heads, 1);
  EXPECT_TRUE(q.tie_embeddings);
}

TEST(HfFlavor, TheRunsSettingsMustAgreeWithTheFileInOneLine) {
  const fs::path dir = loom::testing::temp_dir();
  const fs::path llama = write_config(dir / "llama", llama_config());
  const fs::path qwen = write_config(dir / "qwen3", qwen3_config());
  const models::ModelSpec& spec = models::get_spec("llama3");
  // The family is config.json's model_type; model.name must name it.
  loom::testing::expect_error<UsageError>([&] { spec.build_args(hf_request(qwen)); },
                                    {qwen.string(), "describes a qwen3 model", "model.name is \"llama3\"",
                                     "set model.name = \"qwen3\""});
  auto request = hf_request(llama);
  request.vocab_size = 4096;
  loom::testing::expect_error<UsageError>([&] { spec.build_args(request); },
                                    {"model.vocab_size 4096 differs from the vocab_size 2053", "model.vocab_size = 0"});
  request = hf_request(llama);
  request.vocab_size = 2053;  // equal: fine
  EXPECT_NO_THROW(spec.build_args(request));
  request = hf_request(llama);
  request.min_vocab_size = 3000;
  loom::testing::expect_error<UsageError>([&] { spec.build_args(request); },
                                    {"tokenizer's vocabulary (3000 ids) does not fit the vocab_size 2053",
                                     "model.tokenizer_path"});
  request = hf_request(llama);
  request.n_layers = 5;
  loom::testing::expect_error<UsageError>([&] { spec.build_args(request); },
                                    {"model.n_layers 5 differs from the num_hidden_layers 3", "model.n_layers = 0"});
  // No config.json given.
  loom::testing::expect_error<UsageError>([&] { spec.build_args({models::kHfFlavor, 0, 64, 0}); }, {"model.hf_config"});
}

TEST(HfFlavor, WhereTheConfigJsonComesFrom) {
  const fs::path dir = loom::testing::temp_dir();
  const fs::path hf = write_config(dir / "hf", llama_config());
  EXPECT_EQ(models::resolve_hf_config(hf.string(), ""), hf);                 // the file
  EXPECT_EQ(models::resolve_hf_config((dir / "hf").string(), ""), hf);       // its directory
  EXPECT_EQ(models::resolve_hf_config("", (dir / "hf").string()), hf);       // initial_load_path's
  EXPECT_EQ(models::resolve_hf_config(hf.string(), "/elsewhere"), hf);      // hf_config wins
  loom::testing::expect_error<UsageError>([&] { models::resolve_hf_config("", ""); },
                                    {"model.flavor = \"hf\"", "checkpoint.initial_load_path", "model.hf_config"});
  loom::testing::expect_error<UsageError>([&] { models::resolve_hf_config((dir / "missing.json").string(), ""); },
                                    {"model.hf_config", "missing.json", "does not exist"});
  fs::create_directories(dir / "empty");
  loom::testing::expect_error<UsageError>([&] { models::resolve_hf_config((dir / "empty").string(), ""); },
                                    {"model.hf_config", "is a directory without a config.json"});
  // A Loom checkpoint records its model but is no config.json.
  fs::create_directories(dir / "loom");
  loom::testing::write(dir / "loom" / "metadata.json", "{}");
  loom::testing::expect_error<UsageError>([&] { models::resolve_hf_config("", (dir / "loom").string()); },
                                    {"is a Loom checkpoint", "model.hf_config"});
  // model.hf_config is the "hf" flavor's own setting.
  models::ModelConfig m;
  m.hf_config = hf.string();
  loom::testing::expect_error<UsageError>([&] { models::model_section().validate(&m); }, {"model.hf_config"});
  m.flavor = models::kHfFlavor;
  EXPECT_NO_THROW(models::model_section().validate(&m));
  const models::ModelRequest r = models::model_request(m, "", /*vocab_size=*/2048, /*seq_len=*/32);
  EXPECT_EQ(r.hf_config, hf);
  EXPECT_EQ(r.vocab_size, 0);  // the file's
  EXPECT_EQ(r.min_vocab_size, 2048);
}

// A field value the family cannot express: exit 2, one line naming the file, the field, its value
// and what Loom supports. One case per refusal of each family's reader.
struct Refusal {
  std::string family;
  std::function<void(json&)> edit;
  std::vector<std::string> parts;
};

TEST(HfFlavor, AConfigTheFamilyCannotExpressIsOneLineNamingTheField) {
  const std::vector<Refusal> refusals = {
      {"llama3", [](json& c) { c["hidden_act"] = "gelu"; }, {"hidden_act 'gelu'", "silu"}},
      {"llama3", [](json& c) { c["attention_bias"] = true; }, {"attention_bias", "no biases"}},
      {"llama3", [](json& c) { c["mlp_bias"] = true; }, {"mlp_bias", "no biases"}},
      {"llama3", [](json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; },
       {"rope type 'yarn'", "\"default\" and \"llama3\""}},
      {"llama3", [](json& c) { c["rope_scaling"] = {{"factor", 4.0}}; }, {"\"factor\" but no \"rope_type\""}},
      {"llama3", [](json& c) { c["head_dim"] = 16; }, {"head_dim 16", "hidden_size / num_attention_heads = 8"}},
      {"llama3", [](json& c) { c["partial_rotary_factor"] = 0.5; }, {"partial_rotary_factor 0.5", "need 1.0"}},
      {"llama3", [](json& c) { c["num_key_value_heads"] = 4; }, {"n_heads 6", "n_kv_heads 4"}},
      {"qwen3", [](json& c) { c["hidden_act"] = "gelu"; }, {"hidden_act 'gelu'", "silu"}},
      {"qwen3", [](json& c) { c["attention_bias"] = true; }, {"attention_bias"}},
      {"qwen3", [](json& c) { c["use_sliding_window"] = true; }, {"use_sliding_window", "full causal"}},
      {"qwen3", [](json& c) { c["layer_types"] = {"full_attention", "sliding_attention"}; },
       {"layer_types[1] 'sliding_attention'", "\"full_attention\" on every layer"}},
      {"qwen3", [](json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; },
       {"rope type 'yarn'", "\"default\""}},
      {"qwen3_moe", [](json& c) { c["shared_expert_intermediate_size"] = 32; },
       {"shared_expert_intermediate_size 32", "routed experts only"}},
      {"qwen3_moe", [](json& c) { c["n_shared_experts"] = 1; }, {"n_shared_experts 1", "routed experts only"}},
      {"qwen3_moe", [](json& c) { c["layer_types"] = {"sliding_attention", "full_attention"}; },
       {"layer_types[0] 'sliding_attention'"}},
      {"deepseek_v3", [](json& c) { c["hidden_act"] = "relu"; }, {"hidden_act 'relu'", "silu"}},
      {"deepseek_v3", [](json& c) { c["topk_method"] = "greedy"; }, {"topk_method 'greedy'", "noaux_tc"}},
      {"deepseek_v3", [](json& c) { c["scoring_func"] = "tanh"; }, {"scoring_func 'tanh'", "\"sigmoid\""}},
      {"deepseek_v3", [](json& c) { c["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}}; },
       {"rope type 'linear'", "default or yarn"}},
      {"gpt_oss", [](json& c) { c["hidden_act"] = "gelu"; }, {"hidden_act 'gelu'", "silu"}},
      {"gpt_oss", [](json& c) { c["layer_types"] = {"full_attention", "chunked_attention", "full_attention"}; },
       {"layer_types[1] 'chunked_attention'", "\"sliding_attention\" or \"full_attention\""}},
      {"gpt_oss", [](json& c) { c["layer_types"] = {"full_attention"}; },
       {"layer_types lists 1 layers but num_hidden_layers is 3"}},
      {"gpt_oss", [](json& c) { c["sliding_window"] = nullptr; }, {"sliding_window is null"}},
      {"gpt_oss", [](json& c) { c["rope_parameters"]["rope_type"] = "longrope"; },
       {"rope type 'longrope'", "\"yarn\" and \"default\""}},
      {"gpt_oss", [](json& c) { c["quantization_config"] = {{"quant_method", "bitsandbytes"}}; },
       {"quantization_config.quant_method 'bitsandbytes'", "\"mxfp4\""}},
  };
  const fs::path dir = loom::testing::temp_dir();
  int i = 0;
  for (const Refusal& r : refusals) {
    SCOPED_TRACE(c10::str(r.family, " #", i));
    json config;
    for (const Family& f : families()) {
      if (f.name == r.family) config = f.config();
    }
    r.edit(config);
    const fs::path path = write_config(dir / c10::str("case", i++), config);
    std::vector<std::string> parts = r.parts;
    parts.push_back(path.string());
    loom::testing::expect_error<UsageError>([&] { models::get_spec(r.family).build_args(hf_request(path)); }, parts);
  }
}

}  // namespace
