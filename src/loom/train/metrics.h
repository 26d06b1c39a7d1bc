// Training metrics: one console line (rank 0) and one JSON object per line in
// <dump_folder>/metrics.jsonl for every logged step, plus the throughput arithmetic behind them
// (tokens/s per rank, model FLOPs utilization against a measured fp32 GEMM peak).
#pragma once
#include <nlohmann/json.hpp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/distributed/comm.h"
#include "loom/train/tensorboard.h"

namespace loom::train {

// Peak fp32 GEMM throughput of this process in FLOP/s at its current intra-op thread count
// (at::get_num_threads()): the best rate of 1024x1024x1024 matmuls over `seconds` (0.3 s: what a
// training run spends on it). Cached per thread count and window, so only the first call per
// count pays. Uses no random numbers (RNG streams untouched).
double measure_peak_fp32_flops(double seconds = 0.3);

// A byte count with a decimal unit for the console: 4096 -> "4.1 kB", 33179652 -> "33.2 MB".
std::string human_bytes(double bytes);

// 12345678 -> "12,345,678" (rounded to an integer).
std::string with_thousands(double value);

// Tokens processed per second on this rank.
double tokens_per_second(int64_t tokens, double seconds);

// Model FLOPs utilization in percent: tokens/s x FLOPs/token over peak FLOP/s (all per rank).
double mfu_percent(double tokens_per_second, double flops_per_token, double peak_flops);

// Training FLOPs per token of a dense decoder-only transformer, as TorchTitan counts them:
// 6 x (parameters excluding the token embedding) for the matmuls of forward + backward, plus
// 12 x layers x heads x head_dim x seq_len for attention scores and weighted values.
double dense_transformer_flops_per_token(int64_t non_embedding_params, int64_t num_layers,
                                         int64_t num_heads, int64_t head_dim, int64_t seq_len);

struct StepMetrics {
  int64_t step = 0;
  double loss = 0.0;
  double grad_norm = 0.0;
  double lr = 0.0;
  double tps = 0.0;           // tokens per second per rank
  double mfu = 0.0;           // percent
  double mem_peak_gib = 0.0;  // peak resident memory of this rank since the last log, GiB
  std::map<std::string, double> extra;  // more JSONL keys, e.g. comm_bytes; printed after the rest
  // More JSONL and TensorBoard keys left off the console line (the memory breakdown, which the
  // console shows once after the first step).
  std::map<std::string, double> file_only;
};

// The communication keys of a logged step, per step of the `steps` the snapshot covers (ring-model
// wire bytes this rank sent): "comm_bytes" over every mesh dim, and "comm_bytes/<dim>" for each
// mesh dim that carried traffic (dp_shard, tp, cp, ...), so the total can be split by parallelism
// (TensorBoard groups the per-dim keys under "comm_bytes"). When any collective ran, also the
// exposed communication: "comm_exposed_s", the seconds per step the training thread waited for
// collectives (CommCounter::wait_seconds), and, given the mean step time `step_seconds`,
// "comm_exposed_pct", its share of the step; per mesh dim "comm_exposed_s/<dim>" and per
// collective "comm_exposed_s/<op>@<dim>" (JSONL only).
void add_comm_metrics(StepMetrics& metrics, const distributed::CommSnapshot& snapshot, int64_t steps,
                      double step_seconds = 0.0);

// A metrics.jsonl whose last line was cut (a crash or a full disk while logging: no '\n' at the
// end) would be glued to the first line a resumed run appends, and every reader would then fail on
// that line. This moves the cut bytes, as one line, to the end of "<path>.partial" (nothing is
// lost), truncates `path` to its last complete line and warns naming both; a last line that is a
// whole JSON object and lacks only its '\n' gets it instead. Returns the side file when bytes
// were moved there, else an empty path (also when `path` does not exist). loom::Error naming the
// file and errno's text when it cannot.
std::filesystem::path repair_cut_last_line(const std::filesystem::path& path);

struct MetricsLoggerOptions {
  std::filesystem::path dump_folder;
  bool enable_jsonl = true;
  int rank = 0;  // only rank 0 prints and writes
  // Set when the run resumes from a checkpoint of this step: metrics.jsonl is appended to, after a
  // marker line {"event":"resume","step":N,"attempt":A} (rows logged after N by the interrupted
  // run are superseded by the rows that follow the marker; a cut last line is first repaired,
  // see repair_cut_last_line). Unset: a fresh run, and an existing
  // non-empty metrics.jsonl is first moved aside to metrics.K.jsonl (first free K), never
  // overwritten.
  std::optional<int64_t> resumed_from_step;
  int attempt = 0;  // the launcher's restart count (LOOM_RESTART_COUNT), recorded in the marker
  // TensorBoard event files under <dump_folder>/tb/<YYYYmmdd-HHMMSS>/ (one folder per fresh run,
  // so `tensorboard --logdir <dump_folder>/tb` lists the runs side by side; a resumed run appends
  // a new event file to the newest folder, which TensorBoard reads as the same run).
  bool enable_tensorboard = false;
};

class MetricsLogger {
 public:
  // Creates dump_folder and opens metrics.jsonl on rank 0 (see MetricsLoggerOptions for what
  // happens to an existing one); loom::Error if it cannot.
  explicit MetricsLogger(MetricsLoggerOptions options);

  // Prints the console line and appends + flushes the JSON line (rank 0 only), so a crash loses
  // nothing already logged. loom::Error if an extra key collides with a standard key.
  // `progress` (RunProgress::prefix(): "[step 120/400 · 1m32s · eta 3m35s]") takes the place of
  // "step: N" on the console when given.
  void log(const StepMetrics& metrics, const std::string& progress = {});

  // A row of other scalars for `step` (e.g. validation_loss): `console` printed as it is, then
  // {"step":N,<scalars>} appended to metrics.jsonl and the scalars written to TensorBoard (rank 0
  // only). `loom plot` merges rows of the same step.
  void log_scalars(int64_t step, const std::map<std::string, double>& scalars, const std::string& console);
  // An event line ({"event": ...}, e.g. elastic training's "rows" ledger and "membership"),
  // appended as it is (rank 0 only; readers that plot steps skip lines with "event").
  void log_event(const nlohmann::json& event);

  // "step:   10  loss:  7.2345  grad_norm:  1.0123  lr: 8.00e-04  tps: 12,345  mfu: 12.34%
  //  memory:  1.23GiB" followed by any extra keys; with `progress`, that instead of "step: N".
  static std::string console_line(const StepMetrics& metrics, const std::string& progress = {});
  // {"step":..,"loss":..,"grad_norm":..,"lr":..,"tps":..,"mfu":..,"mem_peak_gib":..,<extra>}.
  // Non-finite numbers become null (JSON has no NaN/inf).
  static std::string json_line(const StepMetrics& metrics);

  const std::filesystem::path& jsonl_path() const { return jsonl_path_; }
  // Where a fresh run moved the previous metrics.jsonl; empty when there was none.
  const std::filesystem::path& rotated_to() const { return rotated_to_; }
  // This run's TensorBoard folder and event file (rank 0 with enable_tensorboard; empty otherwise).
  std::filesystem::path tensorboard_folder() const;
  std::filesystem::path tensorboard_file() const;

  // The scalars TensorBoard gets for a logged step: every key of json_line() but "step", each as
  // the float32 TensorBoard stores, in the same order; non-finite values (null in the JSON) are left
  // out, as a curve has no point for them.
  static std::vector<std::pair<std::string, float>> tensorboard_scalars(const StepMetrics& metrics);

 private:
  void write_line(const std::string& json);

  MetricsLoggerOptions options_;
  std::filesystem::path jsonl_path_;
  std::filesystem::path rotated_to_;
  std::unique_ptr<FILE, int (*)(FILE*)> file_{nullptr, &std::fclose};
  std::unique_ptr<tensorboard::EventFileWriter> tensorboard_;
};

}  // namespace loom::train
