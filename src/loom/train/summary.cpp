#include "loom/train/summary.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

namespace loom::train {
namespace {

std::string fixed(double value, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, value);
  return buf;
}

}  // namespace

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0.0) return "?";
  if (seconds < 9.95) return fixed(seconds, 1) + "s";  // 9.96 would print as "10.0s"
  // Rounded once, to whole seconds or minutes, so 59.6 s reads "1m00s", never "60s".
  const int64_t s = std::llround(seconds);
  if (s < 60) return c10::str(s, "s");
  char buf[32];
  if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
    return buf;
  }
  const int64_t minutes = std::llround(seconds / 60.0);
  std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(minutes / 60),
                static_cast<long long>(minutes % 60));
  return buf;
}

RunProgress::RunProgress(RunProgressOptions options) : options_(options) {
  stats_.total_steps = options_.total_steps;
}

void RunProgress::record_step(int64_t step, double loss, double step_seconds, double elapsed_seconds) {
  record_time(step, step_seconds, elapsed_seconds);
  record_loss(step, loss);
}

void RunProgress::record_time(int64_t step, double step_seconds, double elapsed_seconds) {
  if (steps_recorded_ == 0) stats_.first_step = step;
  ++steps_recorded_;
  last_step_ = step;
  elapsed_ = elapsed_seconds;
  step_seconds_sum_ += step_seconds;
  if (steps_recorded_ > 1) {  // the first step of a process is its warm-up
    recent_.push_back(step_seconds);
    recent_sum_ += step_seconds;
    if (recent_.size() > options_.eta_window) {
      recent_sum_ -= recent_.front();
      recent_.pop_front();
    }
  }
  stats_.last_step = step;
}

void RunProgress::record_loss(int64_t step, double loss) {
  if (std::isfinite(loss)) {
    if (std::isnan(stats_.first_loss)) stats_.first_loss = loss;
    stats_.last_loss = loss;
    if (std::isnan(stats_.best_loss) || loss < stats_.best_loss) {
      stats_.best_loss = loss;
      stats_.best_step = step;
    }
  } else {
    ++stats_.skipped_steps;
  }
}

void RunProgress::record_log(const StepMetrics& metrics) {
  stats_.peak_memory_gib = std::max(stats_.peak_memory_gib, metrics.mem_peak_gib);
}

std::optional<double> RunProgress::eta_seconds() const {
  if (recent_.empty()) return std::nullopt;
  const double mean = recent_sum_ / static_cast<double>(recent_.size());
  return mean * static_cast<double>(std::max<int64_t>(0, options_.total_steps - last_step_));
}

std::string RunProgress::prefix() const {
  std::string out = c10::str("[step ", last_step_, "/", options_.total_steps, " · ",
                             format_duration(elapsed_));
  if (const auto eta = eta_seconds()) out += " · eta " + format_duration(*eta);
  return out + "]";
}

std::string RunProgress::status_line(double loss) const {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%8.4f", loss);
  return prefix() + "  loss: " + buf;
}

RunSummary RunProgress::summary() const {
  RunSummary s = stats_;
  s.wall_seconds = elapsed_;
  s.tokens = steps_recorded_ * options_.global_tokens_per_step;
  if (step_seconds_sum_ > 0.0) {
    s.rank_tokens_per_second =
        static_cast<double>(steps_recorded_) * options_.rank_tokens_per_step / step_seconds_sum_;
    if (std::isfinite(options_.peak_flops) && options_.peak_flops > 0.0) {
      s.mfu = mfu_percent(s.rank_tokens_per_second, options_.flops_per_token, options_.peak_flops);
    }
  }
  if (elapsed_ > 0.0) s.global_tokens_per_second = static_cast<double>(s.tokens) / elapsed_;
  return s;
}

std::vector<std::string> format_run_summary(const RunSummary& s) {
  const auto loss = [](double v) { return std::isfinite(v) ? fixed(v, 4) : std::string("n/a"); };
  // Labels padded to one column, so the paths line up and can be picked out by eye.
  const auto row = [](const std::string& label, const std::string& value) {
    std::string padded = "  " + label + ":";
    padded.resize(std::max<size_t>(padded.size() + 1, 16), ' ');
    return padded + value;
  };
  std::vector<std::string> out;
  out.push_back(c10::str("run summary: steps ", s.first_step, "-", s.last_step, " of ",
                         s.total_steps, ", ", with_thousands(static_cast<double>(s.tokens)),
                         " tokens in ", format_duration(s.wall_seconds)));
  out.push_back(row("throughput", c10::str(with_thousands(s.rank_tokens_per_second),
                                           " tokens/s per rank (",
                                           with_thousands(s.global_tokens_per_second),
                                           " on all ranks, wall clock), MFU ",
                                           std::isfinite(s.mfu) ? fixed(s.mfu, 2) + "%" : "n/a")));
  std::string losses = c10::str("first ", loss(s.first_loss), ", last ", loss(s.last_loss),
                                ", best ", loss(s.best_loss));
  if (std::isfinite(s.best_loss)) losses += c10::str(" (step ", s.best_step, ")");
  if (s.skipped_steps > 0) losses += c10::str("; ", s.skipped_steps, " non-finite step(s) skipped");
  out.push_back(row("loss", losses));
  out.push_back(row("peak memory", fixed(s.peak_memory_gib, 2) + " GiB (rank 0)"));
  out.push_back(row("run folder", s.run_folder));
  out.push_back(row("metrics", s.metrics_path.empty() ? "not written (metrics.enable_jsonl = false)"
                                                      : s.metrics_path));
  out.push_back(row("checkpoints", s.checkpoint_folder.empty()
                                       ? "none (checkpoint.enable = false)"
                                       : s.checkpoint_folder));
  out.push_back(row("tensorboard", s.tensorboard_folder.empty()
                                       ? "off (set metrics.enable_tensorboard = true)"
                                       : s.tensorboard_folder));
  out.push_back(row("plot", s.plot_path.empty()
                                ? "none (it is drawn from metrics.jsonl)"
                                : s.plot_path + " (loss, learning rate and tokens/s against step)"));
  out.push_back("next:");
  if (!s.metrics_path.empty()) {
    out.push_back(c10::str("  loom plot ", s.run_folder, " OTHER_RUN_DIR --out compare.svg",
                           "   # overlay runs"));
  }
  if (!s.tensorboard_folder.empty()) {
    // The folder above this run's: TensorBoard then lists this run beside the folder's earlier ones.
    const std::filesystem::path runs = std::filesystem::path(s.tensorboard_folder).parent_path();
    out.push_back(c10::str("  tensorboard --logdir ", runs.empty() ? s.tensorboard_folder : runs.string(),
                           "   # (.venv/bin/tensorboard after make setup)"));
  }
  if (!s.last_checkpoint.empty()) {
    const std::string tokenizer = s.tokenizer_path.empty() ? "" : " --tokenizer " + s.tokenizer_path;
    out.push_back(c10::str("  loom generate --checkpoint ", s.last_checkpoint, tokenizer,
                           " --prompt \"Once upon a time\"   # sample from the trained model"));
    out.push_back(c10::str("  loom score --checkpoint ", s.last_checkpoint, tokenizer,
                           " --text-file FILE   # per-token loss and perplexity of a text"));
  } else {
    out.push_back("  train with --checkpoint.enable=true to keep the weights, then loom generate / "
                  "loom score --checkpoint <run folder>/checkpoint/step-N");
  }
  return out;
}

}  // namespace loom::train
