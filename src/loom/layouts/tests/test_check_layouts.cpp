// `loom check-layouts` through the built binary on the tiny model (seq 64, 2 steps): PP 2 x TP 2
// matches one process with clipping engaged; a TP reduction skipped in one module
// (LOOM_FAULT_SKIP_TP_REDUCE) is named at that module; bad input is one line with exit 2 before
// anything runs.
#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "loom/testing/run.h"

namespace {

using namespace loom::testing;

// The tiny model (train/tests/layout_runs.h's settings), clipping at 0.5: below its norms.
std::string tiny_overrides() {
  return " -- --model.flavor=tiny --model.tokenizer_path=" + source_path("data/default/tokenizer.json") +
         " --training.dataset_path=" + source_path("data/default/corpus.jsonl") +
         " --training.seq_len=64 --optimizer.lr=1e-3 --lr_scheduler.warmup_steps=2 --training.max_norm=0.5"
         " --metrics.peak_flops=1e11";
}

std::string check_layouts(const std::string& args) {
  return loom_bin() + " check-layouts --config " + source_path("configs/llama3_debug.toml") + " " + args;
}

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// With --probe-step 2 every recorded activation and its gradient is gathered from the four ranks
// (sequence-parallel shards, micro-batches on two stages) and compared too.
TEST(CheckLayoutsRun, PipelineTimesTensorParallelMatchesOneProcess) {
  TempDir dir("check-layouts");
  const auto json = dir.path() / "report.json";
  const RunResult r = run(
      check_layouts("--layout \"pp=2,tp=2\" --steps 2 --probe-step 2 --json " + json.string() + tiny_overrides()), 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("worst gradient"), std::string::npos) << r.output;  // the table
  EXPECT_NE(r.output.find("pp=2,tp=2 matches the reference on all 2 steps"), std::string::npos) << r.output;
  const auto report = read_json(json);
  EXPECT_TRUE(report.at("matches").get<bool>());
  const auto& layout = report.at("layouts").at(0);
  EXPECT_EQ(layout.at("ranks"), 4);
  EXPECT_TRUE(layout.at("first_divergence").is_null());
  int clipped = 0;
  for (const auto& step : layout.at("steps")) {
    EXPECT_EQ(step.at("verdict"), "ok");
    EXPECT_LE(step.at("worst_gradient").at("diff").get<double>(), 1e-5);
    EXPECT_LE(step.at("worst_parameter").at("diff").get<double>(), 1e-5);
    clipped += step.at("grad_norm_ref").get<double>() > 0.5 ? 1 : 0;
  }
  EXPECT_EQ(clipped, 2) << "clipping must engage, or a wrong norm would not change the update";
  const auto& modules = layout.at("activations").at("modules");
  ASSERT_EQ(modules.size(), 14u) << layout.at("activations").dump();  // embedding, 4 x (attention, FFN, block), norm
  EXPECT_EQ(modules.at(0).at("module"), "tok_embeddings");
  EXPECT_EQ(modules.at(13).at("module"), "norm");
  for (const auto& m : modules) {
    EXPECT_LE(m.at("output_diff").get<double>(), 1e-5) << m.dump();
    EXPECT_LE(m.at("grad_diff").get<double>(), 1e-5) << m.dump();
  }
  std::printf("%s\n", r.output.c_str());
}

TEST(CheckLayoutsRun, NamesTheModuleOfABrokenTensorParallelReduction) {
  TempDir dir("check-layouts");
  const auto json = dir.path() / "report.json";
  const RunResult r = run("env LOOM_FAULT_SKIP_TP_REDUCE=layers.1.attention " +
                              check_layouts("--layout tp=2 --steps 1 --json " + json.string() + tiny_overrides()),
                          120);
  ASSERT_EQ(r.exit_code, 1) << r.output;
  const auto report = read_json(json);
  EXPECT_FALSE(report.at("matches").get<bool>());
  const auto& divergence = report.at("layouts").at(0).at("first_divergence");
  EXPECT_EQ(divergence.at("step"), 1);
  EXPECT_EQ(divergence.at("kind"), "gradient");
  ASSERT_TRUE(divergence.contains("module")) << divergence.dump();
  EXPECT_EQ(divergence.at("module").at("name"), "layers.1.attention") << divergence.dump();
  EXPECT_EQ(divergence.at("module").at("what"), "output");
  EXPECT_NE(r.output.find("first module that differs: layers.1.attention"), std::string::npos) << r.output;
  std::printf("%s\n", r.output.c_str());
}

// Bad input: exit 2 and one line, before any run starts (no "running" line, no work folder).
void expect_refused(const std::string& args, const std::string& want) {
  const RunResult r = run(check_layouts(args), 60);
  EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
  EXPECT_NE(r.output.find("error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(want), std::string::npos) << args << "\n" << r.output;
  std::string out = r.output;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  EXPECT_EQ(out.find('\n'), std::string::npos) << "not one line:\n" << r.output;
  EXPECT_EQ(r.output.find("running"), std::string::npos) << r.output;
}

TEST(CheckLayoutsBadInput, OneLineAndExit2BeforeAnythingRuns) {
  const std::string tiny = tiny_overrides();
  expect_refused("--layout zp=2" + tiny, "unknown key 'zp'");
  expect_refused("--layout fsdp=3" + tiny, "do not split over its 3 data-parallel ranks");
  // The model's rules (4 heads do not split over 3 ranks) and the compatibility table's (Muon
  // with TP), through train::check_layout as `loom train` runs it.
  expect_refused("--layout tp=3" + tiny, "layout 'tp=3': ");
  expect_refused("--layout tp=2,optimizer.name=Muon" + tiny, "Muon");
  // More ranks than the machine runs: 4 per core.
  const int too_many = 8 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  expect_refused("--layout fsdp=" + std::to_string(too_many) + tiny + " --training.local_batch_size=" +
                     std::to_string(too_many),
                 "at most 4 ranks per core");
  expect_refused("--layout tp=2" + tiny + " --training.deterministic=false", "training.deterministic = true");
  expect_refused("--layout tp=2" + tiny + " --parallelism.tensor_parallel_degree=2", "--layout");
  expect_refused("--layout tp=2 --tolerance -1" + tiny, "--tolerance");
  expect_refused("--layout tp=2 --steps 2 --probe-step 3" + tiny, "--probe-step");
  TempDir used("check-layouts-used");
  std::ofstream(used.path() / "file") << "x";
  expect_refused("--layout tp=2 --work-dir " + used.str() + tiny, "is not empty");
}

}  // namespace
