// What a person watching a run sees besides the metric lines: where the run is (elapsed time and
// an ETA on every log line, "[step 120/400 · 1m32s · eta 3m35s]") and one summary when it ends
// (steps, tokens, throughput, losses, memory, where its files are and what to run next). The
// Trainer feeds RunProgress one call per step and per log; the formatting lives here so that it is
// unit-tested without training anything.
#pragma once
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "loom/train/metrics.h"

namespace loom::train {

// "0.8s", "45s", "1m32s", "1h05m": the console's durations. Below 10 s one decimal (short runs
// and first steps), minutes with seconds below an hour, hours with minutes above.
std::string format_duration(double seconds);

struct RunProgressOptions {
  int64_t total_steps = 0;  // training.steps
  int64_t start_step = 0;   // steps done before this process started (a resumed run's checkpoint)
  // Tokens of one optimizer step over all ranks, and credited to one rank (tps's convention: a
  // tensor-parallel group shares its tokens).
  int64_t global_tokens_per_step = 0;
  double rank_tokens_per_step = 0.0;
  double flops_per_token = 0.0;
  double peak_flops = std::numeric_limits<double>::quiet_NaN();  // NaN: no MFU
  // The ETA's mean covers this many of the most recent steps: recent enough to follow a lasting
  // change of step time, long enough to ride out a passing one (on a shared 2-core machine another
  // job halved the speed for 40 steps; a 50-step window then overshot the remaining time by 24 %
  // at step 100 of 400, where the mean since warm-up, which this window is there, computed from the
  // same log, was off by about 9 %).
  size_t eta_window = 100;
};

// The run-end summary's figures and paths (paths empty where the run wrote no such thing).
struct RunSummary {
  int64_t first_step = 0;  // the first step this process ran (1 unless resumed)
  int64_t last_step = 0;
  int64_t total_steps = 0;
  int64_t tokens = 0;            // trained on by this process's steps, all ranks
  double wall_seconds = 0.0;     // from the first step's start to the end of training
  double rank_tokens_per_second = 0.0;  // mean over the run, per rank (as `tps`)
  double global_tokens_per_second = 0.0;
  double mfu = std::numeric_limits<double>::quiet_NaN();  // percent; NaN when unknown
  double first_loss = std::numeric_limits<double>::quiet_NaN();
  double last_loss = std::numeric_limits<double>::quiet_NaN();
  double best_loss = std::numeric_limits<double>::quiet_NaN();
  int64_t best_step = 0;
  double peak_memory_gib = 0.0;  // rank 0's peak over the logged windows
  int64_t skipped_steps = 0;     // non-finite steps skipped (training.skip_nonfinite_steps)
  std::string run_folder;
  std::string metrics_path;
  std::string checkpoint_folder;
  std::string last_checkpoint;   // the final step's checkpoint, for `loom score`
  std::string tensorboard_folder;
  std::string plot_path;
  std::string tokenizer_path;    // for the suggested `loom score --text-file`
};

// Elapsed time, ETA and the run's totals, fed once per step by the Trainer.
class RunProgress {
 public:
  explicit RunProgress(RunProgressOptions options);

  // One finished step: its iteration time, its global loss (non-finite for a skipped step) and the
  // wall time since training started. The first step a process runs is its warm-up (allocations,
  // first-touch pages, thread pools) and stays out of the ETA's mean.
  void record_step(int64_t step, double loss, double step_seconds, double elapsed_seconds);
  // The two halves of record_step, for a step whose loss is read from the device later (at the
  // next log step, training.step_readback = "log_steps"): its time now, its loss when known.
  void record_time(int64_t step, double step_seconds, double elapsed_seconds);
  void record_loss(int64_t step, double loss);
  // A logged step's metrics (peak memory is reset per log window, so the run's peak is the max).
  void record_log(const StepMetrics& metrics);

  // Seconds left: the mean of the recent steps' times (after warm-up) x the steps left. nullopt
  // until one step past warm-up has been recorded.
  std::optional<double> eta_seconds() const;
  // "[step 120/400 · 1m32s · eta 3m35s]" for the last recorded step; without "· eta ..." while
  // the ETA is unknown.
  std::string prefix() const;
  // The terminal's line between log steps: prefix() and the step's loss ("  loss:   5.4321").
  std::string status_line(double loss) const;
  // The totals so far; the caller fills in the paths.
  RunSummary summary() const;

 private:
  RunProgressOptions options_;
  int64_t steps_recorded_ = 0;
  int64_t last_step_ = 0;
  double elapsed_ = 0.0;
  double step_seconds_sum_ = 0.0;  // every step, warm-up included: the throughput's denominator
  std::deque<double> recent_;      // the last eta_window step times after warm-up
  double recent_sum_ = 0.0;
  RunSummary stats_;
};

// The summary as lines (without the log prefix), e.g.
//   run summary: steps 1-400 of 400, 1,638,400 tokens in 3m12s
//     throughput: 4,266 tokens/s per rank (8,532 on all ranks), MFU 12.34%
//     loss: first 7.6543, last 3.2109, best 3.1987 (step 388)
//     ...
//   next:
//     loom plot outputs/run outputs/other_run --out compare.svg   (overlay runs)
std::vector<std::string> format_run_summary(const RunSummary& summary);

}  // namespace loom::train
