// Shared by the Trainer's parallel-layout tests (test_trainer_tp/cp/pp/adamw8bit/muon.cpp): the
// `loom train` command of one run of the debug model in some parallel layout, and the comparison
// of its logged losses with the single process's.
#pragma once
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>

#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/checkpoint/state_dict.h"
#include "loom/core/build_paths.h"
#include "loom/testing/run.h"

namespace loom::testing {

// Every checkpoint tensor whole (parameters, optimizer state, step counts), read in one process.
inline std::map<std::string, torch::Tensor> read_whole_checkpoint(const std::filesystem::path& dir) {
  const auto meta = loom::checkpoint::CheckpointMetadata::read(dir);
  loom::checkpoint::ShardedStateDict state;
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : meta.tensors) {
    torch::Tensor whole = torch::empty(t.shape, torch::TensorOptions().dtype(t.dtype));
    state.add_full(name, t.component, whole);
    out[name] = whole;
  }
  loom::checkpoint::load_checkpoint(dir, state, 0);
  return out;
}

// Expects `other` to hold exactly `original`'s tensors, under the same names, each of the same
// dtype and bitwise equal (a checkpoint that went through other layouts and came back).
inline void expect_bitwise_equal_checkpoints(const std::map<std::string, torch::Tensor>& original,
                                             const std::map<std::string, torch::Tensor>& other) {
  ASSERT_EQ(other.size(), original.size());
  for (const auto& [name, t] : original) {
    auto it = other.find(name);
    ASSERT_NE(it, other.end()) << name;
    EXPECT_EQ(it->second.scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(it->second, t)) << name;
  }
}

inline std::string source_path(const std::string& rel) { return std::string(loom::kSourceDir) + "/" + rel; }

// The debug model on the default corpus, seq 64, deterministic, every step logged, lr 1e-3 (the
// debug config's 4e-3 spikes near step 20 and amplifies any rounding difference ~100x); `flags`
// choose the layout.
inline std::string layout_train_args(const TempDir& dir, int steps, int local_batch, const std::string& flags) {
  return " train --config " + source_path("configs/llama3_debug.toml") + " --validation.enable=false" +
         " --model.tokenizer_path=" + source_path("data/default/tokenizer.json") +
         " --training.dataset_path=" + source_path("data/default/corpus.jsonl") + " --job.dump_folder=" +
         dir.str() + " --training.seq_len=64 --training.steps=" + std::to_string(steps) +
         " --training.local_batch_size=" + std::to_string(local_batch) +
         " --training.deterministic=true --optimizer.lr=1e-3 --lr_scheduler.warmup_steps=2"
         " --metrics.log_freq=1 --metrics.peak_flops=1e11 " + flags;
}

// `loom <args>` in one process, or under `loom launch` on `nproc` ranks.
inline std::string loom_command(int nproc, const std::string& args) {
  return nproc == 1 ? bin_dir() + "/loom" + args
                    : bin_dir() + "/loom launch --nproc " + std::to_string(nproc) + " --" + args;
}

// Largest |a[i] - b[i]| / |a[i]| from index `from` on.
inline double worst_relative(const std::vector<double>& a, const std::vector<double>& b, size_t from = 0) {
  double worst = 0;
  for (size_t i = from; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(a[i]));
  return worst;
}

// Copies checkpoint folder `from` into `run_dir`'s checkpoint folder as step-<step>, has a
// `loom_resave_worker` job on `nproc` ranks load it in the layout `flags` choose (FSDP over all
// ranks unless they say otherwise; local batch 8 / nproc) and save it again without training;
// returns the re-saved folder. The checkpoint round trips between layouts use it.
inline std::filesystem::path resave_checkpoint(const TempDir& run_dir, const std::filesystem::path& from, int step,
                                               int nproc, const std::string& flags) {
  const std::string name = "step-" + std::to_string(step);
  std::filesystem::create_directories(run_dir.path() / "checkpoint");
  std::filesystem::copy(from, run_dir.path() / "checkpoint" / name, std::filesystem::copy_options::recursive);
  const std::string args = layout_train_args(run_dir, 2 * step, 8 / nproc,
                                             flags + " --parallelism.data_parallel_shard_degree=" + std::to_string(nproc));
  const std::string worker_args = args.substr(args.find("--config"));
  RunResult r = run(bin_dir() + "/loom launch --nproc " + std::to_string(nproc) + " --exec -- " + bin_dir() +
                        "/loom_resave_worker " + (run_dir.path() / "resaved").string() + " " + worker_args,
                    300);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return run_dir.path() / "resaved" / name;
}

// One parallel layout of a parity test.
struct Layout {
  const char* name;
  int nproc;
  int local_batch;
  std::string flags;
};

// The run's parameters after its last step, gathered whole: its final checkpoint converted to
// Hugging Face's format by `loom convert` (which reassembles every TP box and FSDP range).
inline std::map<std::string, torch::Tensor> gathered_parameters(const TempDir& dir, int step) {
  const auto hf = dir.path() / "hf";
  RunResult r = run(bin_dir() + "/loom convert --to hf --input " +
                    (dir.path() / "checkpoint" / ("step-" + std::to_string(step))).string() + " --output " +
                    hf.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::map<std::string, torch::Tensor> out;
  if (r.exit_code != 0) return out;
  loom::checkpoint::SafetensorsFile file(hf / "model.safetensors");
  for (const auto& name : file.names()) out[name] = file.tensor(name).clone();
  return out;
}

// Largest difference over all tensors, each as ||got - want|| / ||want|| (Frobenius). Elementwise
// ratios are the wrong yardstick after AdamW: an element whose gradient is ~0 moves by up to lr per
// step in a direction set by rounding (its m / sqrt(v) is noise), so single elements differ by
// ~1e-5 absolute (2e-4 of a small tensor's largest element) while the tensor agrees to ~4e-6.
inline double worst_parameter_difference(const std::map<std::string, torch::Tensor>& want,
                                  const std::map<std::string, torch::Tensor>& got) {
  EXPECT_EQ(want.size(), got.size());
  double worst = 0;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    EXPECT_NE(it, got.end()) << name;
    if (it == got.end()) continue;
    const double scale = std::max(w.norm().item<double>(), 1e-12);
    worst = std::max(worst, (it->second - w).norm().item<double>() / scale);
  }
  return worst;
}

}  // namespace loom::testing
