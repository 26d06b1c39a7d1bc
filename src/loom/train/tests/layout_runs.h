// Shared by the Trainer's parallel-layout tests (test_trainer_tp.cpp, test_trainer_cp.cpp): the
// `loom train` command of one run of the debug model in some parallel layout, and the comparison
// of its logged losses with the single process's.
#pragma once
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "loom/core/build_paths.h"
#include "loom/testing/run.h"

namespace loom::testing {

inline std::string source_path(const std::string& rel) { return std::string(loom::kSourceDir) + "/" + rel; }

// The debug model on the default corpus, seq 64, deterministic, every step logged, lr 1e-3 (the
// debug config's 4e-3 spikes near step 20 and amplifies any rounding difference ~100x); `flags`
// choose the layout.
inline std::string layout_train_args(const TempDir& dir, int steps, int local_batch, const std::string& flags) {
  return " train --config " + source_path("configs/llama3_debug.toml") +
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

// One parallel layout of a parity test.
struct Layout {
  const char* name;
  int nproc;
  int local_batch;
  std::string flags;
};

}  // namespace loom::testing
