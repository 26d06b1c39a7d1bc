// model.flavor = "hf" through the `loom` binary: a shape no built-in flavor has, read from a
// Hugging Face config.json, trains, records its shape in its checkpoints and resumes; a resume
// whose config.json has another shape, and the settings that cannot go with the file, are one
// line and exit 2. (The loss against transformers' on Hugging Face weights of every family:
// tests/parity/test_hf_flavor.py.)
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <string>

#include "loom/testing/run.h"

namespace {
using loom::testing::bin_dir;
using loom::testing::losses;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::source_path;
using loom::testing::TempDir;
namespace fs = std::filesystem;

// A Qwen3 of its own shape (5 heads of 12 over width 40, 1 KV head, ffn 72, vocab 2053 > the
// tokenizer's 2048), initialized from training.seed: only the shape comes from the file.
nlohmann::json qwen3_config(int64_t ffn = 72) {
  return {{"model_type", "qwen3"},        {"hidden_size", 40},         {"intermediate_size", ffn},
          {"num_hidden_layers", 2},       {"num_attention_heads", 5},  {"num_key_value_heads", 1},
          {"head_dim", 12},               {"vocab_size", 2053},        {"rms_norm_eps", 1e-6},
          {"max_position_embeddings", 128}, {"rope_theta", 1000000.0}, {"hidden_act", "silu"},
          {"tie_word_embeddings", false}};
}

void write_config(const fs::path& path, const nlohmann::json& config) { std::ofstream(path) << config.dump(2); }

std::string train_args(const TempDir& dir, const fs::path& config, int steps, const std::string& name = "qwen3") {
  return " train --config " + source_path("configs/llama3_debug.toml") +
         " --validation.enable=false --model.name=" + name + " --model.flavor=hf --model.hf_config=" +
         config.string() + " --model.tokenizer_path=" + source_path("data/default/tokenizer.json") +
         " --training.dataset_path=" + source_path("data/default/corpus.jsonl") + " --job.dump_folder=" + dir.str() +
         " --training.seq_len=32 --training.local_batch_size=2 --training.deterministic=true --training.steps=" +
         std::to_string(steps) +
         " --metrics.log_freq=1 --metrics.peak_flops=1e11 --parallelism.data_parallel_shard_degree=1"
         " --checkpoint.enable=true --checkpoint.interval=2";
}

std::string train(const TempDir& dir, const fs::path& config, int steps, const std::string& name = "qwen3") {
  return bin_dir() + "/loom" + train_args(dir, config, steps, name);
}

size_t error_lines(const std::string& output) {
  size_t lines = 0;
  for (size_t p = output.find("error:"); p != std::string::npos; p = output.find("error:", p + 1)) ++lines;
  return lines;
}

}  // namespace

TEST(TrainerHfFlavor, TrainsAtTheFilesShapeRecordsItAndAResumeVerifiesIt) {
  TempDir files("hf-files"), straight("hf-straight"), resumed("hf-resumed");
  const fs::path config = files.path() / "config.json";
  write_config(config, qwen3_config());

  RunResult a = run(train(straight, config, 4), 300);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("model: qwen3 hf (dim 40, 2 layers, 5 heads (1 kv) x 12, ffn 72, vocab 2053"), std::string::npos)
      << a.output;
  // The checkpoint records the shape itself (what `loom convert` and a resume read), not "hf".
  std::ifstream in(straight.path() / "checkpoint" / "step-2" / "metadata.json");
  const nlohmann::json metadata = nlohmann::json::parse(in);
  const nlohmann::json& model = metadata.at("json").at("model");
  EXPECT_EQ(model.at("name"), "qwen3") << model.dump();
  EXPECT_EQ(model.at("model_args").at("dim"), 40);
  EXPECT_EQ(model.at("model_args").at("ffn_dim"), 72);
  EXPECT_EQ(model.at("model_args").at("vocab_size"), 2053);

  // Interrupted after step 2, resumed with the same config.json: the straight run's losses.
  fs::create_directories(resumed.path() / "checkpoint");
  fs::copy(straight.path() / "checkpoint" / "step-2", resumed.path() / "checkpoint" / "step-2",
           fs::copy_options::recursive);
  RunResult b = run(train(resumed, config, 4), 300);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("resumed from"), std::string::npos) << b.output;
  const auto la = losses(straight), lb = losses(resumed);
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(lb.size(), 2u);
  EXPECT_EQ(lb[0], la[2]);
  EXPECT_EQ(lb[1], la[3]);

  // Two FSDP ranks, each reading config.json itself (and comparing what they built), one row each:
  // the single process's losses on the same global batch.
  TempDir fsdp("hf-fsdp");
  RunResult f = run(bin_dir() + "/loom launch --nproc 2 --" + train_args(fsdp, config, 4) +
                        " --training.local_batch_size=1 --parallelism.data_parallel_shard_degree=-1",
                    300);
  ASSERT_EQ(f.exit_code, 0) << f.output;
  const auto lf = losses(fsdp);
  ASSERT_EQ(lf.size(), 4u);
  for (size_t i = 0; i < lf.size(); ++i) EXPECT_NEAR(lf[i], la[i], 1e-5 * std::abs(la[i])) << "step " << i + 1;

  // The same folder resumed with a config.json of another shape: one line naming the field.
  write_config(config, qwen3_config(/*ffn=*/80));
  RunResult c = run(train(resumed, config, 6), 300);
  EXPECT_EQ(c.exit_code, 2) << c.output;
  EXPECT_EQ(error_lines(c.output), 1u) << c.output;
  EXPECT_NE(c.output.find("holds a model of another shape than this run's (model_args.ffn_dim 72 in the "
                          "checkpoint, 80 in this run)"),
            std::string::npos)
      << c.output;
  EXPECT_NE(c.output.find(config.string()), std::string::npos) << c.output;
}

TEST(TrainerHfFlavor, SettingsThatCannotGoWithTheFileAreOneLineExit2) {
  TempDir files("hf-bad"), run_dir("hf-bad-run");
  const fs::path config = files.path() / "config.json";
  write_config(config, qwen3_config());
  struct Case {
    std::string args;
    std::string expect;
  };
  const Case cases[] = {
      // The family is config.json's; model.name must agree.
      {train(run_dir, config, 2, "llama3"), "describes a qwen3 model (its model_type) but model.name is \"llama3\""},
      {train(run_dir, config, 2) + " --model.vocab_size=4096", "model.vocab_size 4096 differs from the vocab_size 2053"},
      {train(run_dir, config, 2) + " --model.n_layers=3", "model.n_layers 3 differs from the num_hidden_layers 2"},
      {train(run_dir, files.path() / "none.json", 2), "does not exist"},
      // A value the family cannot express, before any process group.
      {train(run_dir, config, 2) + " --model.flavor=tiny", "model.hf_config"},
  };
  for (const Case& c : cases) {
    RunResult r = run(c.args, 120);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_EQ(error_lines(r.output), 1u) << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << r.output;
  }
  nlohmann::json sliding = qwen3_config();
  sliding["layer_types"] = {"full_attention", "sliding_attention"};
  write_config(config, sliding);
  RunResult r = run(train(run_dir, config, 2), 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(error_lines(r.output), 1u) << r.output;
  EXPECT_NE(r.output.find("layer_types[1] 'sliding_attention' is not supported"), std::string::npos) << r.output;
}

// The resume check is the recorded shape's, whatever the flavor: a named flavor resumed with
// another depth is one line naming the field too (not a tensor-shape error deep in the load).
TEST(TrainerHfFlavor, ANamedFlavorResumedAtAnotherShapeIsOneLine) {
  TempDir dir("named-resume");
  const std::string args = bin_dir() + "/loom train --config " + source_path("configs/llama3_debug.toml") +
                           " --validation.enable=false --model.flavor=tiny --model.tokenizer_path=" +
                           source_path("data/default/tokenizer.json") + " --training.dataset_path=" +
                           source_path("data/default/corpus.jsonl") + " --job.dump_folder=" + dir.str() +
                           " --training.seq_len=32 --training.local_batch_size=2 --metrics.log_freq=1"
                           " --parallelism.data_parallel_shard_degree=1 --checkpoint.enable=true"
                           " --checkpoint.interval=2";
  RunResult a = run(args + " --training.steps=2", 300);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  RunResult b = run(args + " --training.steps=4 --model.n_layers=3", 300);
  EXPECT_EQ(b.exit_code, 2) << b.output;
  EXPECT_EQ(error_lines(b.output), 1u) << b.output;
  EXPECT_NE(b.output.find("(model_args.n_layers 4 in the checkpoint, 3 in this run); resume with the model.flavor, "
                          "model.n_layers and model.vocab_size it was trained with"),
            std::string::npos)
      << b.output;
}
