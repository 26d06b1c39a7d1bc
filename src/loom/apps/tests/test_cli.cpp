// The `loom` dispatcher, through the binary: what a mistyped or missing command answers.
#include <gtest/gtest.h>

#include <cmath>
#include <unistd.h>
#include <filesystem>
#include <fstream>

#include <string>

#include <torch/cuda.h>

#include "loom/core/build_paths.h"
#include "loom/testing/run.h"

namespace {
using loom::testing::count_occurrences;
using loom::testing::loom_bin;
using loom::testing::run;

const std::string kAvailable =
    "; available: launch, train, plot, ledger, rl, score, generate, tokenizer, info, convert, pipeline, plan, check-layouts (see 'loom --help')";

// Issue 8 H: these printed only "A subcommand is required".
TEST(LoomCli, UnknownCommandsAndOptionsListTheCommands) {
  struct Case {
    std::string args, expected;
  };
  const Case cases[] = {
      {"frobnicate", "error: unknown command 'frobnicate'" + kAvailable},
      {"--frob", "error: unknown option '--frob'" + kAvailable},
      {"", "error: no command given" + kAvailable},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const auto r = run(loom_bin() + " " + c.args, 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(r.output, c.expected + "\n");
    EXPECT_EQ(count_occurrences(r.output, "\n"), 1);
  }
  // Commands and help still reach CLI11.
  const auto help = run(loom_bin() + " --help", 60);
  EXPECT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("tokenizer"), std::string::npos) << help.output;
  const auto info = run(loom_bin() + " info --flavor debugmodel", 60);
  EXPECT_EQ(info.exit_code, 0) << info.output;
}

}  // namespace

// The binary binds the C++ standard library to libstdc++ before libtorch: with torch 2.11, whose
// libtorch exports copies of std::filesystem symbols, the other order crashed every
// std::filesystem::remove_all (issue 9). libstdc++ must be the first NEEDED entry.
namespace test_cli {
// How many lines of `text` contain `part` (the launcher's line quoting a rank's counts once).
int lines_containing(const std::string& text, const std::string& part) {
  int n = 0;
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = std::min(text.find('\n', start), text.size());
    n += text.substr(start, end - start).find(part) != std::string::npos ? 1 : 0;
    start = end + 1;
  }
  return n;
}
}  // namespace test_cli

// Issue 22, item 3: usage errors of `loom launch` and of the ranks' command exit 2, which
// `--max-restarts` never retries (before: exit 1 and three attempts of `-- frobnicate`), in one line.
TEST(LoomCli, LaunchUsageErrorsExit2WithoutRestarts) {
  struct Case {
    std::string args, expected;
  };
  const Case cases[] = {
      // Refused by the launcher before any rank starts.
      {"launch --nproc 2 --max-restarts 2 -- frobnicate",
       "error: loom launch: 'frobnicate' is not a loom command the ranks can run; available: launch, train, "
       "plot, ledger, rl, score, generate, tokenizer, info, convert, pipeline, plan, check-layouts (or --exec to run another program)"},
      {"launch --max-restarts 2 -- train", "error: --nproc is required (see 'loom --help')"},
      // A required option the ranks' command lacks: each rank's report says exit 2.
      {"launch --nproc 2 --max-restarts 2 -- plot",
       "exited with code 2 (configuration or usage error): [rank"},
      // Item 11: the hint quotes the ranks' words in the order typed (before: 'train x.toml --config').
      {"launch --nproc 2 train --config x.toml",
       "error: loom launch does not take '--config'; put the ranks' command after '--', e.g. "
       "'loom launch --nproc 2 -- train --config x.toml'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const auto r = run(loom_bin() + " " + c.args, 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("loom launch: restart"), std::string::npos) << r.output;
    EXPECT_EQ(test_cli::lines_containing(r.output, "error: "), 1) << r.output;
  }
}

// Issue 22, item 3: one rule for every enum-valued config key: matched as written, and a value that
// differs only in case is a one-line error naming the exact spelling (before: `gpipe` got the whole
// list of schedules).
// `loom plan`: the config's own layout explained, the search's table and command, and a request
// that describes no run as one line with exit 2.
TEST(LoomCli, PlanExplainsSearchesAndRefusesBadRequestsInOneLine) {
  const std::string base = loom_bin() + " plan --config " + loom::testing::source_path("configs/llama3_debug.toml") +
                           " --model.tokenizer_path=" + loom::testing::source_path("data/default/tokenizer.json") +
                           " --validation.enable=false";
  const auto explain = run(base + " --explain --world-size 2 --parallelism.tensor_parallel_degree=2 "
                                  "--parallelism.data_parallel_shard_degree=1", 60);
  EXPECT_EQ(explain.exit_code, 0) << explain.output;
  EXPECT_NE(explain.output.find("tp 2, local batch"), std::string::npos) << explain.output;
  EXPECT_NE(explain.output.find("predicted memory per device"), std::string::npos) << explain.output;
  const auto table = run(base + " --world-size 4 --training.global_batch_size=8 --top 3", 60);
  EXPECT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("layouts training accepts"), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("first: loom launch --nproc 4 -- train"), std::string::npos) << table.output;
  struct Case {
    std::string args, expected;
  };
  const Case cases[] = {
      {" --world-size 0", "error: --world-size must be at least 1, got 0"},
      {" --world-size 2", "error: loom plan needs the global batch"},
      {" --world-size 2 --training.global_batch_size=8 --cluster a100", "error: unknown cluster 'a100'; use h100, h200 or cpu"},
      {" --explain --world-size 3 --parallelism.data_parallel_shard_degree=2", "error: "},
      // Issue 46 (11): a world that no number of equal nodes makes, and cluster constants that are
      // no positive finite number (a negative one read as "not given" and was silently replaced).
      {" --world-size 8 --devices-per-node 3 --training.global_batch_size=8",
       "error: --world-size 8 is not a multiple of --devices-per-node 3"},
      {" --world-size 2 --training.global_batch_size=8 --cluster h100 --peak-flops -1",
       "error: --peak-flops: must be a finite number > 0, got -1"},
      {" --world-size 2 --training.global_batch_size=8 --cluster h100 --efficiency nan",
       "error: --efficiency: must be a finite number > 0, got nan"},
      {" --world-size 2 --training.global_batch_size=8 --cluster h100 --inter-latency -0.5",
       "error: --inter-latency: must be a finite number >= 0, got -0.5"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const auto r = run(base + c.args, 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(r.output.rfind(c.expected, 0), 0u) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "\n"), 1) << r.output;
  }
}

// Ranked by time, each layout runs with the fastest activation checkpointing (and FSDP resharding)
// that fits: the 8B on 8 H100s needs none at 80 GiB; capped at 20 GiB the best layout checkpoints,
// and its command says so; with --fixed-memory-settings (the config's: none) nothing fits there.
TEST(LoomCli, PlanChoosesActivationCheckpointingWhereMemoryIsShort) {
  const std::string config = ::testing::TempDir() + "plan_8b_" + std::to_string(::getpid()) + ".toml";
  std::ofstream(config) << "[model]\nname = \"llama3\"\nflavor = \"8B\"\nvocab_size = 128256\n[training]\n"
                           "seq_len = 8192\nglobal_batch_size = 16\nmixed_precision_param = \"bfloat16\"\n"
                           "[validation]\nenable = false\n";
  const std::string base = loom_bin() + " plan --config " + config + " --world-size 8 --cluster h100 --top 1";
  auto first_row = [](const std::string& output) {
    const size_t at = output.find("\n   1 ");
    return at == std::string::npos ? std::string() : output.substr(at + 1, output.find('\n', at + 1) - at - 1);
  };
  const auto roomy = run(base, 60);
  EXPECT_EQ(roomy.exit_code, 0) << roomy.output;
  EXPECT_NE(first_row(roomy.output).find(", no AC"), std::string::npos) << roomy.output;
  // H100s have float8 GEMMs: Float8 is chosen (the 8B's linears are multiples of 16) and named in
  // the command; with the config's settings kept it is not.
  EXPECT_NE(first_row(roomy.output).find(", Float8"), std::string::npos) << roomy.output;
  EXPECT_NE(roomy.output.find("--float8.enable=true"), std::string::npos) << roomy.output;
  const auto tight = run(base + " --memory-gib 20", 60);
  EXPECT_EQ(tight.exit_code, 0) << tight.output;
  const std::string row = first_row(tight.output);
  EXPECT_TRUE(row.find("selective AC (per op)") != std::string::npos || row.find("full AC") != std::string::npos)
      << tight.output;
  EXPECT_NE(tight.output.find("--activation_checkpoint.mode="), std::string::npos) << tight.output;
  const auto fixed = run(base + " --memory-gib 20 --fixed-memory-settings", 60);
  // Without checkpointing no layout of the 8B fits in 20 GiB: choosing it is what made one fit.
  // Nothing fitting is one line, exit 2, naming the smallest peak and its layout (issue 46, 11).
  EXPECT_EQ(fixed.exit_code, 2) << fixed.output;
  EXPECT_EQ(fixed.output.rfind("error: no layout of llama3 8B on 8 devices fits in 20 GiB per device: the smallest "
                               "needs ", 0), 0u) << fixed.output;
  EXPECT_NE(fixed.output.find("raise --memory-gib"), std::string::npos) << fixed.output;
  EXPECT_EQ(count_occurrences(fixed.output, "\n"), 1) << fixed.output;
  const auto kept = run(base + " --fixed-memory-settings", 60);
  EXPECT_EQ(kept.output.find("Float8"), std::string::npos) << kept.output;
  std::filesystem::remove(config);
  std::printf("80 GiB: %s\n20 GiB: %s\n", first_row(roomy.output).c_str(), row.c_str());
}

// Issue 50, item 4: for a given layout (NeMo AutoModel's published Llama 3 70B row: 64 H100s, CP 2
// x FSDP 32, GBS 128, MBS 1, seq 8192, bf16; docs.nvidia.com/nemo/automodel/latest/performance/
// performance-summary.md) `loom plan --explain --cluster` prints the step broken down, the layout at
// its fastest settings that fit, its rank among the layouts training accepts, and the nearest
// published row with the prediction's error against it.
TEST(LoomCli, PlanExplainsAGivenLayoutAgainstItsRankAndThePublishedRow) {
  const std::string config = ::testing::TempDir() + "plan_70b_" + std::to_string(::getpid()) + ".toml";
  std::ofstream(config) << "[model]\nname = \"llama3\"\nflavor = \"70B\"\nvocab_size = 128256\n[training]\n"
                           "seq_len = 8192\nglobal_batch_size = 128\nlocal_batch_size = 1\n"
                           "mixed_precision_param = \"bfloat16\"\n[validation]\nenable = false\n[parallelism]\n"
                           "data_parallel_shard_degree = 32\ncontext_parallel_degree = 2\n";
  const auto r = run(loom_bin() + " plan --config " + config + " --world-size 64 --cluster h100 --explain "
                     "--efficiency 0.522", 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dp_shard 32 x cp 2, local batch 1 x 4 accumulated"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("predicted step on h100: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" + FSDP "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("with the fastest memory settings that fit 80 GiB: dp_shard 32 x cp 2"), std::string::npos)
      << r.output;
  const size_t rank = r.output.find("rank among the ");
  ASSERT_NE(rank, std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(top ", rank), std::string::npos) << r.output;
  const size_t nearest = r.output.find("nearest published row: llama3 70B on 64 GPUs, seq 8192, global batch 128");
  ASSERT_NE(nearest, std::string::npos) << r.output;
  EXPECT_NE(r.output.find("867 tokens/s per GPU", nearest), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("performance-summary", nearest), std::string::npos) << r.output;
  // The error printed is the prediction's against the row: within 25 % (PlanPublished.* checks the
  // number itself).
  const size_t pct = r.output.find(" %)", nearest);
  ASSERT_NE(pct, std::string::npos) << r.output;
  const size_t open = r.output.rfind('(', pct);
  const double error = std::stod(r.output.substr(open + 1, pct - open - 1));
  EXPECT_LE(std::abs(error), 25.0) << r.output;
  const auto bad = run(loom_bin() + " plan --config " + config + " --world-size 64 --cluster h100 --explain "
                       "--fsdp-accumulate maybe", 60);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  std::filesystem::remove(config);
}

TEST(LoomCli, EnumKeysDifferingInCaseNameTheExactSpelling) {
  struct Case {
    std::string flag, expected;
  };
  const Case cases[] = {
      {"--parallelism.pipeline_parallel_schedule=gpipe",
       "error: config key 'parallelism.pipeline_parallel_schedule' is case-sensitive: got \"gpipe\" in "
       "command-line override '--parallelism.pipeline_parallel_schedule=gpipe'; did you mean 'GPipe'?\n"},
      {"--optimizer.name=adamw",
       "error: config key 'optimizer.name' is case-sensitive: got \"adamw\" in command-line override "
       "'--optimizer.name=adamw'; did you mean 'AdamW'?\n"},
      {"--lr_scheduler.decay_type=Cosine",
       "error: config key 'lr_scheduler.decay_type' is case-sensitive: got \"Cosine\" in command-line "
       "override '--lr_scheduler.decay_type=Cosine'; did you mean 'cosine'?\n"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flag);
    const auto r = run(loom_bin() + " train --config " + loom::testing::source_path("configs/llama3_debug.toml") +
                           " " + c.flag, 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(r.output, c.expected);
  }
}

TEST(LoomBinary, LinksLibstdcxxBeforeLibtorch) {
  const auto r = run("readelf -d " + loom_bin());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const size_t stdcxx = r.output.find("[libstdc++.so");
  const size_t torch = r.output.find("[libtorch");
  ASSERT_NE(stdcxx, std::string::npos) << r.output;
  ASSERT_NE(torch, std::string::npos) << r.output;
  EXPECT_LT(stdcxx, torch) << r.output;
  EXPECT_LT(stdcxx, r.output.find("[libc10")) << r.output;
}

// Issue 9: asking for a GPU where there is none is one line and exit 2, before any work; where
// there is one, a short single-process run trains on it.
TEST(LoomBinary, TrainingDeviceCuda) {
  const std::string src = loom::kSourceDir;
  const loom::testing::TempDir dir("cuda");
  const auto r = run(loom_bin() + " train --config " + src + "/configs/llama3_debug.toml --validation.enable=false" +
                     " --model.tokenizer_path=" + src + "/data/default/tokenizer.json" +
                     " --training.dataset_path=" + src + "/data/default/corpus.jsonl" +
                     " --job.dump_folder=" + dir.str() + " --training.device=cuda --training.steps=3" +
                     " --training.seq_len=64 --training.local_batch_size=2 --metrics.log_freq=1" +
                     " --metrics.peak_flops=1e11", 300);
  if (torch::cuda::is_available()) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("device: cuda:0"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("[step 3/3 · "), std::string::npos) << r.output;
    return;
  }
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "error: "), 1) << r.output;
  EXPECT_NE(r.output.find("error: training.device = \"cuda\" but"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[step "), std::string::npos) << r.output;
}

// `loom score` and `loom convert` take --device too; without a GPU, cuda is one line and exit 2
// before any model is read. GPUs are hidden, so a GPU machine checks the same thing (tests/cuda
// runs both commands on its GPU).
TEST(LoomBinary, ScoreAndConvertDeviceCuda) {
  const loom::testing::TempDir dir("device");
  for (const std::string& cmd :
       {" score --device cuda --tokens 1,2,3 --checkpoint " + dir.str(),
        " convert --to loom --device cuda --input " + dir.str() + " --output " + dir.str() + "/out"}) {
    const auto r = run("env CUDA_VISIBLE_DEVICES= " + loom_bin() + cmd);
    EXPECT_EQ(r.exit_code, 2) << cmd << "\n" << r.output;
    EXPECT_EQ(count_occurrences(r.output, "error: "), 1) << r.output;
    EXPECT_NE(r.output.find("error: --device cuda but"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("use --device cpu"), std::string::npos) << r.output;
  }
}
