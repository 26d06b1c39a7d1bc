// `loom rl` under FSDP 2, TP 2, their product and DDP 2 equals one process (issue 51): the same
// sampled tokens and rewards, step for step, and the same loss and gradient norm (1e-5 relative)
// with clipping that engages, for the sequence-mean and the token-mean GRPO loss and with the KL
// term. The base is a fresh two-layer debug
// model saved as a Loom checkpoint, its end-of-text logit made large so completions end at
// different lengths (the data-parallel ranks then decode in lockstep through FSDP's gathers).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/data/byte_level.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/model_dir.h"
#include "loom/models/spec.h"
#include "loom/testing/run.h"

namespace {
namespace fs = std::filesystem;
using loom::testing::bin_dir;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;
using nlohmann::json;

constexpr double kMaxNorm = 0.02;  // below every step's norm: clipping engages

// Byte-level BPE over the 256 bytes plus Llama 3's <|begin_of_text|> 256 and <|end_of_text|> 257.
void write_tokenizer(const fs::path& path) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[loom::data::byte_level::to_alphabet(std::string(1, static_cast<char>(b)))] = b;
  json added = json::array();
  added.push_back({{"id", 256}, {"content", "<|begin_of_text|>"}, {"special", true}, {"normalized", false}});
  added.push_back({{"id", 257}, {"content", "<|end_of_text|>"}, {"special", true}, {"normalized", false}});
  const json j = {{"version", "1.0"},
                  {"added_tokens", added},
                  {"normalizer", nullptr},
                  {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                  {"decoder", {{"type", "ByteLevel"}}},
                  {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
  std::ofstream(path) << j.dump();
}

// The job: tokenizer, base checkpoint, prompts and config under `dir`.
fs::path write_job(const fs::path& dir) {
  write_tokenizer(dir / "tokenizer.json");
  const loom::models::ModelSpec& spec = loom::models::get_spec("llama3");
  loom::models::ModelRequest request;
  request.flavor = "debugmodel";
  request.vocab_size = 258;
  request.seq_len = 64;
  request.n_layers = 2;
  const auto args = spec.build_args(request);
  auto decoder = std::dynamic_pointer_cast<loom::models::Decoder>(spec.build_model(*args, torch::TensorOptions()));
  decoder->init_weights(5);
  {
    // The end-of-text row scaled up: its logit is large wherever it is positive, so about half the
    // completions end early, at different lengths.
    torch::NoGradGuard no_grad;
    torch::Tensor head = decoder->output().weight();
    head[257].mul_(4.0);
  }
  loom::models::save_loom_checkpoint(spec, *decoder, dir / "base");
  std::ofstream prompts(dir / "prompts.jsonl");
  for (int i = 0; i < 8; ++i) prompts << json{{"prompt", std::to_string(i) + "+" + std::to_string(i % 3) + "="}}.dump() << "\n";
  const fs::path config = dir / "rl.toml";
  std::ofstream(config) << "[model]\nname = \"llama3\"\nflavor = \"debugmodel\"\nn_layers = 2\n"
                        << "tokenizer_path = \"" << (dir / "tokenizer.json").string() << "\"\n"
                        // Adam's eps well above the rounding of a gradient entry: with 1e-8, an entry
                        // whose gradient is within rounding of 0 moves by +-lr on its sign alone, and
                        // two summation orders part at the next step for that reason only.
                        << "[optimizer]\nname = \"AdamW\"\nlr = 0.05\neps = 1e-3\nweight_decay = 0.0\n"
                        // A constant lr: the updates this test's norms and clipping were chosen for
                        // (the schedule's default warmup would scale them down by 1/6 .. 6/6).
                        << "[lr_scheduler]\nwarmup_steps = 0\ndecay_ratio = 0.0\n"
                        << "[training]\nsteps = 3\nseed = 3\nseq_len = 64\nmax_norm = " << kMaxNorm << "\n"
                        << "[lora]\nrank = 4\nalpha = 8.0\ntarget_modules = \"all-linear\"\n"
                        << "[checkpoint]\ninitial_load_path = \"" << (dir / "base").string() << "\"\n"
                        << "[rl]\nprompts = \"" << (dir / "prompts.jsonl").string() << "\"\n"
                        // Two updates per rollout: the second's ratio is not 1, so the loss (the last
                        // update's) is not the sum of a group's advantages, which is 0.
                        << "prompts_per_step = 4\ngroup_size = 4\nmax_new_tokens = 5\ntemperature = 1.0\n"
                        << "updates_per_rollout = 2\n"
                        // A reward that differs within groups: the length of the request's line, mod 3;
                        // every request is also kept, to count how often each row is scored.
                        << "reward = \"command\"\nreward_command = \"tee -a " << (dir / "requests.jsonl").string()
                        << " | awk '{print length($0) % 3}'\"\n";
  return config;
}

struct RlRun {
  std::vector<json> metrics;
  std::map<std::pair<int64_t, int64_t>, json> rollouts;  // (step, global index) -> its line
};

RlRun run_rl(const fs::path& config, const fs::path& dump, int nproc, const std::string& overrides) {
  const std::string args = "rl --config " + config.string() + " --job.dump_folder=" + dump.string() + " " + overrides;
  const RunResult r = nproc == 1 ? run(bin_dir() + "/loom " + args, 300)
                                 : run(bin_dir() + "/loom launch --nproc " + std::to_string(nproc) + " --exec -- " +
                                           bin_dir() + "/loom " + args,
                                       300);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  RlRun out;
  out.metrics = loom::testing::read_jsonl(dump / "metrics.jsonl");
  for (const auto& file : fs::directory_iterator(dump / "rollouts")) {
    for (const json& line : loom::testing::read_jsonl(file.path())) {
      const auto key = std::make_pair(line.at("step").get<int64_t>(), line.at("index").get<int64_t>());
      // Tensor-parallel ranks of one replica sample the same rows: each writes them, identically.
      if (out.rollouts.count(key) != 0) EXPECT_EQ(out.rollouts[key], line) << file.path();
      out.rollouts[key] = line;
    }
  }
  return out;
}

void expect_same_run(const RlRun& one, const RlRun& parallel, const std::string& what) {
  ASSERT_EQ(one.metrics.size(), 3u) << what;
  ASSERT_EQ(parallel.metrics.size(), one.metrics.size()) << what;
  EXPECT_EQ(parallel.rollouts, one.rollouts) << what;
  EXPECT_EQ(one.rollouts.size(), 3u * 16u) << what;
  double worst_loss = 0, worst_norm = 0;  // relative, printed: the margin to 1e-5
  for (size_t i = 0; i < one.metrics.size(); ++i) {
    const json& a = one.metrics[i];
    const json& b = parallel.metrics[i];
    EXPECT_EQ(a.at("reward").get<double>(), b.at("reward").get<double>()) << what << " step " << i + 1;
    EXPECT_EQ(a.at("completion_tokens").get<double>(), b.at("completion_tokens").get<double>()) << what;
    const double loss = a.at("loss").get<double>(), norm = a.at("grad_norm").get<double>();
    EXPECT_NEAR(b.at("loss").get<double>(), loss, 1e-5 * std::abs(loss)) << what << " step " << i + 1;
    EXPECT_NEAR(b.at("grad_norm").get<double>(), norm, 1e-5 * norm) << what << " step " << i + 1;
    EXPECT_GT(norm, kMaxNorm) << what << ": clipping must engage";
    EXPECT_NE(loss, 0.0) << what;
    worst_loss = std::max(worst_loss, std::abs(b.at("loss").get<double>() - loss) / std::abs(loss));
    worst_norm = std::max(worst_norm, std::abs(b.at("grad_norm").get<double>() - norm) / norm);
  }
  std::printf("%s: loss within %.2e, grad norm within %.2e relative of one process\n", what.c_str(), worst_loss,
              worst_norm);
}

}  // namespace

TEST(RlParallel, FsdpAndTensorParallelEqualOneProcess) {
  TempDir dir("rl_parallel");
  const fs::path config = write_job(dir.path());
  struct Layout {
    std::string name;
    int nproc;
    std::string overrides;
  };
  const std::string tp_flags =
      "--parallelism.tensor_parallel_degree=2 --parallelism.disable_sequence_parallel=true "
      "--parallelism.disable_loss_parallel=true";
  const Layout fsdp{"FSDP 2", 2, "--parallelism.data_parallel_shard_degree=2"};
  const Layout tp{"TP 2", 2, "--parallelism.data_parallel_shard_degree=1 " + tp_flags};
  const Layout fsdp_tp{"FSDP 2 x TP 2", 4, "--parallelism.data_parallel_shard_degree=2 " + tp_flags};
  const Layout ddp{"DDP 2", 2,
                   "--parallelism.data_parallel_shard_degree=1 --parallelism.data_parallel_replicate_degree=2"};
  // The sequence-mean and the token-mean loss; the KL term to the base (the adapters switched off).
  const std::vector<std::pair<std::string, std::vector<Layout>>> cases = {
      {"--rl.loss_type=grpo", {fsdp, tp, fsdp_tp, ddp}},
      {"--rl.loss_type=bnpo", {fsdp, tp}},
      {"--rl.loss_type=grpo --rl.kl_beta=0.5", {fsdp, tp, ddp}},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto& [rl, layouts] = cases[c];
    const RlRun one = run_rl(config, dir.path() / c10::str("one_", c), 1, rl);
    // Some completions end early, so the ranks' decoding lengths differ.
    std::set<size_t> lengths;
    for (const auto& [key, line] : one.rollouts) lengths.insert(line.at("tokens").size());
    EXPECT_GT(lengths.size(), 1u);
    for (size_t l = 0; l < layouts.size(); ++l) {
      const Layout& layout = layouts[l];
      expect_same_run(one,
                      run_rl(config, dir.path() / c10::str("run_", c, "_", l), layout.nproc,
                             layout.overrides + " " + rl),
                      layout.name + " " + rl);
    }
  }
  // Every run scored each of its 3 x 16 rows once: the tensor-parallel ranks of a replica do not
  // run the reward command twice.
  size_t runs = 0;
  for (const auto& [rl, layouts] : cases) runs += 1 + layouts.size();
  // (Lines counted, not parsed: two data-parallel ranks append to the file at once.)
  EXPECT_EQ(static_cast<size_t>(loom::testing::count_occurrences(
                loom::testing::file_bytes(dir.path() / "requests.jsonl"), "\n")),
            runs * 3 * 16);
  // Each layout saved its adapters: one process as a PEFT directory, several as a Loom checkpoint.
  EXPECT_TRUE(fs::exists(dir.path() / "one_0" / "adapters" / "step-3" / "adapter_config.json"));
  EXPECT_TRUE(fs::exists(dir.path() / "run_0_0" / "adapters" / "step-3" / "metadata.json"));
}

// Layouts rl does not run under: one line each, before any rendezvous.
TEST(RlParallel, UnsupportedLayoutsRefused) {
  TempDir dir("rl_parallel_refusals");
  const fs::path config = write_job(dir.path());
  const auto refused = [&](const std::string& overrides, const std::vector<std::string>& parts) {
    const RunResult r = run(bin_dir() + "/loom launch --nproc 2 --exec -- " + bin_dir() + "/loom rl --config " +
                                config.string() + " --job.dump_folder=" + (dir.path() / "x").string() + " " + overrides,
                            120);
    EXPECT_NE(r.exit_code, 0) << overrides;
    for (const std::string& part : parts) EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
  };
  refused("--parallelism.data_parallel_shard_degree=1 --parallelism.pipeline_parallel_degree=2",
          {"pipeline parallelism", "parallelism.pipeline_parallel_degree"});
  refused("--parallelism.data_parallel_shard_degree=1 --parallelism.tensor_parallel_degree=2",
          {"parallelism.disable_sequence_parallel = true"});
  refused("--parallelism.data_parallel_shard_degree=2 --rl.prompts_per_step=3", {"rl.prompts_per_step = 3", "multiple of 2"});
}
