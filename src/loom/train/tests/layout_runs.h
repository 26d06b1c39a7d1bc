// Shared by the Trainer's parallel-layout tests (test_trainer_*.cpp): the `loom train` command of
// one run of the tiny model in some parallel layout, the single-process reference runs cached in the
// build folder, and the comparison of a run's logged losses and final parameters with them.
#pragma once
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

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

// What the layout-parity tests train: the Llama 3 "tiny" flavor (dim 64, 4 layers, 4 heads, ffn 256,
// the tokenizer's 2048-token vocabulary), the smallest shape that TP 4, CP 4, four pipeline stages
// and float8's multiples of 16 all split. It exercises every code path the debug model does (the
// layouts split the same modules), at a twentieth of the compute, so a run costs its start-up.
inline const std::string kTinyModel = " --model.flavor=tiny";

// The gradient-clipping threshold of every layout-parity run: below the tiny model's gradient norms
// over its first steps, so clipping engages on most of them and a wrong norm changes the update
// (a norm reduction that misses a group of ranks is otherwise invisible in the losses: issue 45).
// expect_layout_matches_single_process checks that the reference clipped on at least half its
// steps.
inline const std::string kLayoutMaxNorm = "0.44";

// The tiny model on the default corpus, seq 64, deterministic, every step logged, lr 1e-3 (at the
// debug config's 4e-3 the loss spikes and amplifies any rounding difference ~100x); `flags` choose
// the layout (a later --model.flavor overrides the tiny one).
inline std::string layout_train_args(const std::string& dump_folder, int steps, int local_batch, const std::string& flags) {
  return " train --config " + source_path("configs/llama3_debug.toml") + " --validation.enable=false" + kTinyModel +
         " --model.tokenizer_path=" + source_path("data/default/tokenizer.json") +
         " --training.dataset_path=" + source_path("data/default/corpus.jsonl") + " --job.dump_folder=" +
         dump_folder + " --training.seq_len=64 --training.steps=" + std::to_string(steps) +
         " --training.local_batch_size=" + std::to_string(local_batch) +
         " --training.deterministic=true --optimizer.lr=1e-3 --lr_scheduler.warmup_steps=2"
         " --training.max_norm=" + kLayoutMaxNorm + " --metrics.log_freq=1 --metrics.peak_flops=1e11 " + flags;
}
inline std::string layout_train_args(const TempDir& dir, int steps, int local_batch, const std::string& flags) {
  return layout_train_args(dir.str(), steps, local_batch, flags);
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

// How gtest prints a layout parameter (found by argument-dependent lookup).
inline void PrintTo(const Layout& l, std::ostream* os) { *os << l.name << " on " << l.nproc << " ranks: " << l.flags; }

// A parameterised layout test's name: the layout's (EveryLayout/TrainerTPLayout.…/tp4).
inline std::string layout_test_name(const ::testing::TestParamInfo<Layout>& info) { return info.param.name; }

// The parameters of a run folder's checkpoint step-<step>, gathered whole in this process (the
// loader reassembles every TP box and FSDP range, as `loom convert` does, without a process of
// its own per layout).
inline std::map<std::string, torch::Tensor> gathered_parameters(const std::filesystem::path& dir, int step) {
  const auto checkpoint = dir / "checkpoint" / ("step-" + std::to_string(step));
  std::map<std::string, torch::Tensor> out;
  const auto meta = loom::checkpoint::CheckpointMetadata::read(checkpoint);
  loom::checkpoint::ShardedStateDict state;
  for (const auto& [name, t] : meta.tensors) {
    if (t.component != "model") continue;  // optimizer moments and schedules are not compared here
    torch::Tensor whole = torch::empty(t.shape, torch::TensorOptions().dtype(t.dtype));
    state.add_full(name, t.component, whole);
    out[name] = whole;
  }
  EXPECT_FALSE(out.empty()) << checkpoint;
  loom::checkpoint::load_checkpoint(checkpoint, state, 0);
  return out;
}
inline std::map<std::string, torch::Tensor> gathered_parameters(const TempDir& dir, int step) {
  return gathered_parameters(dir.path(), step);
}

// A run kept in <build>/test-cache, keyed by its command line and by the size and time of every
// file it reads (the loom binary, the config, the tokenizer, the corpus): the single-process
// reference of a parity table runs once per build however many tests, test binaries and re-runs
// compare against it. A lock file serialises tests that want the same run at once (ctest -j); a
// folder without its DONE marker (a run that failed or was killed) is run again. With
// `gather_step` > 0 the run must have saved that step's checkpoint, for gathered_parameters.
// Returns the run folder, or an empty path after reporting a failed run.
inline std::filesystem::path cached_run(int nproc, int steps, int local_batch, const std::string& flags,
                                        int gather_step = 0, int limit_seconds = 600) {
  namespace fs = std::filesystem;
  const std::string marker = "@DUMP_FOLDER@";
  const std::string command = loom_command(nproc, layout_train_args(marker, steps, local_batch, flags));
  std::ostringstream key;
  key << command << " gather " << gather_step;
  for (const fs::path& file : {fs::path(bin_dir()) / "loom", fs::path(source_path("configs/llama3_debug.toml")),
                               fs::path(source_path("data/default/tokenizer.json")),
                               fs::path(source_path("data/default/corpus.jsonl"))}) {
    std::error_code ec;
    key << " " << file.string() << ":" << fs::file_size(file, ec) << ":"
        << fs::last_write_time(file, ec).time_since_epoch().count();
  }
  char name[32];
  std::snprintf(name, sizeof(name), "%016zx", std::hash<std::string>{}(key.str()));
  const fs::path cache = fs::path(bin_dir()).parent_path() / "test-cache";
  fs::create_directories(cache);
  const fs::path dir = cache / name;
  const int lock = ::open((cache / (std::string(name) + ".lock")).c_str(), O_CREAT | O_RDWR, 0644);
  EXPECT_GE(lock, 0) << "cannot open the test cache's lock file in " << cache;
  if (lock >= 0) ::flock(lock, LOCK_EX);
  if (!fs::exists(dir / "DONE")) {
    fs::remove_all(dir);
    std::string to_run = command;
    to_run.replace(to_run.find(marker), marker.size(), dir.string());
    RunResult r = run(to_run, limit_seconds);
    bool ok = r.exit_code == 0;
    EXPECT_TRUE(ok) << "the cached reference run failed:\n" << to_run << "\n" << r.output;
    if (ok && gather_step > 0) {
      ok = std::filesystem::exists(dir / "checkpoint" / ("step-" + std::to_string(gather_step)) / "metadata.json");
      EXPECT_TRUE(ok) << "the cached reference run saved no step-" << gather_step << " checkpoint:\n" << r.output;
    }
    if (ok) std::ofstream(dir / "DONE") << key.str() << "\n";
  }
  const bool done = fs::exists(dir / "DONE");
  if (lock >= 0) ::close(lock);  // releases the lock
  return done ? dir : fs::path();
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

// Every run of a parity table saves its final state (a run always saves its last step when
// checkpoints are on), whose parameters are compared gathered.
inline const std::string kSaveLast = " --checkpoint.enable=true --checkpoint.interval=1000";


// What a parity table holds each layout to: per-step losses within `loss`, per-step gradient norms
// within `norm` (< 0: the loss tolerance) and, when `params` >= 0, the gathered final parameters
// within `params` (relative, as worst_relative and worst_parameter_difference measure); a
// tolerance of 0 means bitwise.
struct Tolerance {
  double loss;
  double params = -1;
  double norm = -1;
};

// training.max_norm as a run with these flags after layout_train_args's has it (the last one given).
inline double effective_max_norm(const std::string& flags) {
  const std::string key = "--training.max_norm=";
  const size_t at = flags.rfind(key);
  return std::stod(at == std::string::npos ? kLayoutMaxNorm : flags.substr(at + key.size()));
}

// How many of a run's steps were clipped: a logged gradient norm above `max_norm`.
inline int clipped_steps(const std::vector<double>& grad_norms, double max_norm) {
  return static_cast<int>(std::count_if(grad_norms.begin(), grad_norms.end(), [&](double n) { return n > max_norm; }));
}

// The single process with the table's global batch (8 rows per step unless `flags` say
// otherwise), cached: the reference every layout of a parity table is compared with.
inline std::filesystem::path single_process_reference(const std::string& flags, int steps, bool gather) {
  return cached_run(1, steps, 8, flags + " --parallelism.data_parallel_shard_degree=1" + (gather ? kSaveLast : ""),
                    gather ? steps : 0);
}

// One layout against the single-process reference with the same `model_flags` (e.g. a mask, an
// optimizer, --model.n_layers): it runs `steps` steps in the layout and must match within `tol`.
// The reference trains (its last loss below its first), so a table cannot pass on a model that
// does not learn. Prints the measured differences.
// `check_parameters`, when given (with tol.params >= 0), also sees the layout's gathered parameters.
// `reference_flags` go to the reference only (e.g. Float8's: one process accumulating micro-batches
// of the layout's rows, whose scales are per micro-batch).
// `check_run`, when given, sees the layout's run folder (its metrics.jsonl) before it is removed.
inline void expect_layout_matches_single_process(
    const Layout& l, const std::string& model_flags, int steps, Tolerance tol,
    const std::function<void(const std::map<std::string, torch::Tensor>&)>& check_parameters = nullptr,
    const std::string& reference_flags = "",
    const std::function<void(const std::filesystem::path&)>& check_run = nullptr) {
  const bool gather = tol.params >= 0;
  const auto reference = single_process_reference(model_flags + reference_flags, steps, gather);
  ASSERT_FALSE(reference.empty());
  const auto want = logged_losses(reference);
  ASSERT_EQ(want.size(), static_cast<size_t>(steps));
  EXPECT_LT(want.back(), want.front());
  // Clipping engages on at least half the reference's steps, so a wrong norm would change them.
  const auto want_norms = logged_grad_norms(reference);
  ASSERT_EQ(want_norms.size(), want.size());
  const double max_norm = effective_max_norm(model_flags + reference_flags);
  const int clipped = clipped_steps(want_norms, max_norm);
  EXPECT_GE(2 * clipped, steps) << "the reference clipped on " << clipped << " of " << steps << " steps (max_norm "
                                << max_norm << "): too few for a wrong norm to matter; lower training.max_norm";
  TempDir dir(l.name);
  RunResult r = run(loom_command(l.nproc, layout_train_args(dir, steps, l.local_batch,
                                                            model_flags + " " + l.flags + (gather ? kSaveLast : "") +
                                                                layout_breakage())),
                    600);
  ASSERT_EQ(r.exit_code, 0) << l.name << "\n" << r.output;
  const auto got = logged_losses(dir.path());
  ASSERT_EQ(got.size(), want.size()) << l.name;
  const double worst = worst_relative(want, got);
  if (tol.loss == 0) {
    EXPECT_EQ(got, want) << l.name << ": per-step losses must be bitwise the single process's";
  } else {
    EXPECT_LE(worst, tol.loss) << l.name;
  }
  const auto got_norms = logged_grad_norms(dir.path());
  ASSERT_EQ(got_norms.size(), want_norms.size()) << l.name;
  const double norm_tol = tol.norm >= 0 ? tol.norm : tol.loss;
  const double worst_norm = worst_relative(want_norms, got_norms);
  if (norm_tol == 0) {
    EXPECT_EQ(got_norms, want_norms) << l.name << ": per-step gradient norms must be bitwise the single process's";
  } else {
    EXPECT_LE(worst_norm, norm_tol) << l.name << ": the gradient norm differs from the single process's";
  }
  if (check_run) check_run(dir.path());
  double worst_param = 0;
  if (gather) {
    const auto parameters = gathered_parameters(dir, steps);
    worst_param = worst_parameter_difference(gathered_parameters(reference, steps), parameters);
    EXPECT_LE(worst_param, tol.params) << l.name;
    if (check_parameters) check_parameters(parameters);
  }
  std::printf("%-36s %2d ranks, %2d steps (%d clipped): max relative difference from the single process: loss %.2e, "
              "grad norm %.2e (final loss %.6f vs %.6f)%s\n",
              l.name, l.nproc, steps, clipped, worst, worst_norm, got.back(), want.back(),
              gather ? c10::str("; gathered parameters: relative L2 difference ", worst_param).c_str() : "");
}

}  // namespace loom::testing
