#include "loom/train/metrics.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <mutex>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/strings.h"
#include "loom/core/timer.h"

namespace loom::train {
namespace {

constexpr const char* kStandardKeys[] = {"step", "loss", "grad_norm", "lr",
                                         "tps",  "mfu",  "mem_peak_gib"};


std::string printf_string(const char* format, double value) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, value);
  return buf;
}

}  // namespace

std::string human_bytes(double bytes) {
  if (!std::isfinite(bytes)) return c10::str(bytes);
  constexpr const char* kUnits[] = {"B", "kB", "MB", "GB", "TB"};
  int unit = 0;
  double v = bytes;
  while (std::abs(v) >= 1000.0 && unit < 4) v /= 1000.0, ++unit;
  return unit == 0 ? printf_string("%.0f B", v) : printf_string("%.1f ", v) + kUnits[unit];
}

std::string with_thousands(double value) {
  if (!std::isfinite(value)) return c10::str(value);
  std::string digits = std::to_string(static_cast<int64_t>(std::llround(value)));
  const size_t first = digits[0] == '-' ? 1 : 0;
  for (int64_t pos = static_cast<int64_t>(digits.size()) - 3; pos > static_cast<int64_t>(first);
       pos -= 3) {
    digits.insert(static_cast<size_t>(pos), ",");
  }
  return digits;
}

double measure_peak_fp32_flops(double seconds) {
  static std::mutex mutex;
  static std::map<std::pair<int, double>, double> cache;
  const int threads = at::get_num_threads();
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find({threads, seconds}); it != cache.end()) return it->second;

  at::NoGradGuard no_grad;
  constexpr int64_t n = 1024;
  constexpr int kMatmulsPerSample = 4;
  const at::Tensor a = at::full({n, n}, 0.5f);
  const at::Tensor b = at::full({n, n}, 0.25f);
  at::Tensor c = at::empty({n, n});
  at::mm_out(c, a, b);  // warm up the BLAS threads and caches
  const double flops_per_sample = 2.0 * n * n * n * kMatmulsPerSample;
  double best = 0.0;
  const Timer total;
  do {
    const Timer sample;
    for (int i = 0; i < kMatmulsPerSample; ++i) at::mm_out(c, a, b);
    best = std::max(best, flops_per_sample / sample.seconds());
  } while (total.seconds() < seconds);
  cache.emplace(std::make_pair(threads, seconds), best);
  return best;
}

double tokens_per_second(int64_t tokens, double seconds) {
  LOOM_REQUIRE(seconds > 0.0, "tokens_per_second needs a positive duration, got ", seconds, " s");
  return static_cast<double>(tokens) / seconds;
}

double mfu_percent(double tokens_per_second, double flops_per_token, double peak_flops) {
  LOOM_REQUIRE(peak_flops > 0.0, "MFU needs a positive peak FLOP/s, got ", peak_flops,
               "; set metrics.peak_flops or leave it 0 to measure");
  return 100.0 * tokens_per_second * flops_per_token / peak_flops;
}

double dense_transformer_flops_per_token(int64_t non_embedding_params, int64_t num_layers,
                                         int64_t num_heads, int64_t head_dim, int64_t seq_len) {
  return 6.0 * static_cast<double>(non_embedding_params) +
         12.0 * static_cast<double>(num_layers) * static_cast<double>(num_heads) *
             static_cast<double>(head_dim) * static_cast<double>(seq_len);
}

void add_comm_metrics(StepMetrics& m, const distributed::CommSnapshot& snapshot, int64_t steps, double step_seconds) {
  LOOM_REQUIRE(steps > 0, "add_comm_metrics needs a positive step count, got ", steps);
  const double per_step = 1.0 / static_cast<double>(steps);
  m.extra["comm_bytes"] = snapshot.total().wire_bytes.value() * per_step;
  for (const auto& [key, counter] : snapshot.counters) {
    const std::string name = "comm_bytes/" + key.second;
    if (m.extra.count(name) == 0) m.extra[name] = snapshot.total_for_dim(key.second).wire_bytes.value() * per_step;
    const std::string exposed = "comm_exposed_s/" + key.second;
    if (m.file_only.count(exposed) == 0) m.file_only[exposed] = snapshot.total_for_dim(key.second).wait_seconds * per_step;
    // And per collective: which ones compute does not hide (the first all-gather, the last
    // reduce-scatter, the gradient norm's all-reduce, ...).
    m.file_only[c10::str("comm_exposed_s/", distributed::to_string(key.first), "@", key.second)] =
        counter.wait_seconds * per_step;
  }
  if (snapshot.counters.empty()) return;  // one process: nothing to wait for
  const double exposed = snapshot.total().wait_seconds * per_step;
  m.extra["comm_exposed_s"] = exposed;
  if (step_seconds > 0) m.extra["comm_exposed_pct"] = 100.0 * exposed / step_seconds;
}

std::filesystem::path repair_cut_last_line(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0 && errno == ENOENT) return {};
  LOOM_REQUIRE(fd >= 0, "cannot open '", path.string(), "' to check its last line: ", errno_text());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  LOOM_REQUIRE(::fstat(fd, &st) == 0, "cannot read '", path.string(), "': ", errno_text());
  if (!S_ISREG(st.st_mode) || st.st_size == 0) return {};
  // Back from the end to the last '\n'; the bytes after it are the cut line.
  const auto size = static_cast<int64_t>(st.st_size);
  int64_t end_of_complete = 0;  // bytes up to and including the last '\n'
  std::string tail;
  char chunk[4096];
  for (int64_t stop = size; stop > 0;) {
    const int64_t start = std::max<int64_t>(0, stop - static_cast<int64_t>(sizeof(chunk)));
    const ssize_t n = ::pread(fd, chunk, static_cast<size_t>(stop - start), start);
    LOOM_REQUIRE(n == stop - start, "cannot read '", path.string(), "': ", errno_text());
    const std::string_view bytes(chunk, static_cast<size_t>(n));
    const size_t newline = bytes.rfind('\n');
    if (newline != std::string_view::npos) {
      end_of_complete = start + static_cast<int64_t>(newline) + 1;
      tail.insert(0, bytes.substr(newline + 1));
      break;
    }
    tail.insert(0, bytes);
    stop = start;
  }
  if (tail.empty()) return {};  // ends with '\n': nothing was cut
  if (nlohmann::json::accept(tail)) {
    // Only the '\n' was lost: the record is whole, so it stays.
    LOOM_REQUIRE(::pwrite(fd, "\n", 1, size) == 1, "cannot repair '", path.string(), "': ", errno_text());
    return {};
  }
  const std::filesystem::path side = path.string() + ".partial";
  {
    std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(side.c_str(), "ab"), &std::fclose);
    LOOM_REQUIRE(out != nullptr, "cannot move the cut last line of '", path.string(), "' to '", side.string(),
                 "': ", errno_text(), "; free space in job.dump_folder");
    const std::string line = tail + "\n";
    const bool ok = std::fwrite(line.data(), 1, line.size(), out.get()) == line.size() &&
                    std::fflush(out.get()) == 0 && ::fsync(::fileno(out.get())) == 0;
    LOOM_REQUIRE(ok, "cannot move the cut last line of '", path.string(), "' to '", side.string(), "': ",
                 errno_text(), "; free space in job.dump_folder");
  }
  // Only now that the bytes are safe in the side file.
  LOOM_REQUIRE(::ftruncate(fd, end_of_complete) == 0, "cannot truncate '", path.string(), "': ", errno_text());
  log::warn("metrics: the last line of ", path.string(), " was cut (", tail.size(),
            " bytes, a crash or a full disk while logging); moved it to ", side.string(),
            " and the resumed run appends after the last complete line");
  return side;
}

MetricsLogger::MetricsLogger(MetricsLoggerOptions options)
    : options_(std::move(options)), jsonl_path_(options_.dump_folder / "metrics.jsonl") {
  if (options_.rank != 0) return;
  std::error_code ec;
  std::filesystem::create_directories(options_.dump_folder, ec);
  LOOM_REQUIRE(!ec, "cannot create dump folder '", options_.dump_folder.string(),
               "': ", ec.message(), "; set job.dump_folder to a writable path");
  const bool resuming = options_.resumed_from_step.has_value();
  if (options_.enable_tensorboard) {
    const std::filesystem::path tb = options_.dump_folder / "tb";
    // Folder names are local start times, so the newest run's sorts last.
    std::filesystem::path folder;
    if (resuming && std::filesystem::is_directory(tb, ec)) {
      for (const auto& entry : std::filesystem::directory_iterator(tb, ec)) {
        if (entry.is_directory() && (folder.empty() || entry.path().filename() > folder.filename())) {
          folder = entry.path();
        }
      }
    }
    if (folder.empty()) {
      const std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      char name[32];
      std::strftime(name, sizeof(name), "%Y%m%d-%H%M%S", &local);
      folder = tb / name;
    }
    tensorboard_ = std::make_unique<tensorboard::EventFileWriter>(folder);
  }
  if (!options_.enable_jsonl) return;
  if (!resuming && std::filesystem::file_size(jsonl_path_, ec) > 0 && !ec) {
    // A fresh run in a folder that already holds metrics: keep them, under the first free name.
    for (int k = 1;; ++k) {
      const auto candidate = options_.dump_folder / c10::str("metrics.", k, ".jsonl");
      if (std::filesystem::exists(candidate, ec)) continue;
      std::filesystem::rename(jsonl_path_, candidate, ec);
      LOOM_REQUIRE(!ec, "cannot move the previous '", jsonl_path_.string(), "' aside to '",
                   candidate.string(), "': ", ec.message(), "; move it away yourself");
      rotated_to_ = candidate;
      log::info("metrics: the previous run's metrics.jsonl was moved to ", candidate.string());
      break;
    }
  }
  if (resuming) repair_cut_last_line(jsonl_path_);
  file_.reset(std::fopen(jsonl_path_.c_str(), resuming ? "a" : "w"));
  LOOM_REQUIRE(file_ != nullptr, "cannot open '", jsonl_path_.string(), "' for writing: ",
               std::strerror(errno), "; set job.dump_folder to a writable path");
  if (resuming) {
    nlohmann::ordered_json marker;
    marker["event"] = "resume";
    marker["step"] = *options_.resumed_from_step;
    marker["attempt"] = options_.attempt;
    write_line(marker.dump());
  }
}

void MetricsLogger::write_line(const std::string& json) {
  const bool ok = std::fputs(json.c_str(), file_.get()) >= 0 && std::fputc('\n', file_.get()) != EOF &&
                  std::fflush(file_.get()) == 0;
  LOOM_REQUIRE(ok, "cannot write to '", jsonl_path_.string(), "': ", std::strerror(errno));
}

std::string MetricsLogger::console_line(const StepMetrics& m, const std::string& progress) {
  std::string line = c10::str(progress.empty() ? "step: " + printf_string("%5.0f", static_cast<double>(m.step)) : progress,
                              "  loss: ", printf_string("%8.4f", m.loss),
                              "  grad_norm: ", printf_string("%8.4f", m.grad_norm),
                              "  lr: ", printf_string("%.2e", m.lr),
                              "  tps: ", with_thousands(m.tps),
                              // nan: the device's peak is unknown (metrics.peak_flops unset)
                              "  mfu: ", std::isfinite(m.mfu) ? printf_string("%.2f", m.mfu) + "%" : std::string("n/a"),
                              "  memory: ", printf_string("%.2f", m.mem_peak_gib), "GiB");
  // Bytes sent per step, human-readably: the total, then each mesh dimension that carries at least
  // 1 % of it when more than one does (a lone dimension repeats the total; a scalar all-reduce of
  // a few bytes is not traffic worth a column). metrics.jsonl keeps every exact figure.
  const std::string kComm = "comm_bytes";
  const auto total = m.extra.find(kComm);
  std::vector<std::pair<std::string, double>> dims;
  for (const auto& [key, value] : m.extra) {
    if (key.rfind(kComm + "/", 0) == 0 && total != m.extra.end() && value >= 0.01 * total->second && value > 0) {
      dims.emplace_back(key.substr(kComm.size() + 1), value);
    }
  }
  for (const auto& [key, value] : m.extra) {
    if (key == kComm) {
      line += "  comm: " + human_bytes(value);
      if (dims.size() > 1) {
        std::string parts;
        for (const auto& [dim, bytes] : dims) parts += (parts.empty() ? "" : ", ") + dim + " " + human_bytes(bytes);
        line += " (" + parts + ")";
      }
      // The training thread's wait for collectives: what communication compute did not hide.
      if (const auto exposed = m.extra.find("comm_exposed_s"); exposed != m.extra.end()) {
        line += "  exposed: " + printf_string("%.1f", exposed->second * 1e3) + "ms";
        if (const auto pct = m.extra.find("comm_exposed_pct"); pct != m.extra.end()) {
          line += " (" + printf_string("%.1f", pct->second) + "%)";
        }
      }
    } else if (key.rfind(kComm + "/", 0) != 0 && key != "comm_exposed_s" && key != "comm_exposed_pct") {
      line += c10::str("  ", key, ": ", value);
    }
  }
  return line;
}

std::string MetricsLogger::json_line(const StepMetrics& m) {
  nlohmann::ordered_json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  j["grad_norm"] = m.grad_norm;
  j["lr"] = m.lr;
  j["tps"] = m.tps;
  j["mfu"] = m.mfu;
  j["mem_peak_gib"] = m.mem_peak_gib;
  for (const auto* keys : {&m.extra, &m.file_only}) {
    for (const auto& [key, value] : *keys) {
      for (const char* standard : kStandardKeys) {
        LOOM_REQUIRE(key != standard, "extra metric '", key,
                     "' collides with a standard metrics key; rename it");
      }
      j[key] = value;
    }
  }
  return j.dump();  // NaN and inf are written as null
}

void MetricsLogger::log(const StepMetrics& metrics, const std::string& progress) {
  if (options_.rank != 0) return;
  const std::string json = json_line(metrics);  // validates extra keys before printing anything
  log::info(console_line(metrics, progress));
  if (tensorboard_) tensorboard_->write_scalars(metrics.step, tensorboard_scalars(metrics));
  if (file_ == nullptr) return;
  write_line(json);
}

void MetricsLogger::log_event(const nlohmann::json& event) {
  if (options_.rank != 0 || file_ == nullptr) return;
  write_line(event.dump());
}

void MetricsLogger::log_scalars(int64_t step, const std::map<std::string, double>& scalars,
                                const std::string& console) {
  if (options_.rank != 0) return;
  log::info(console);
  nlohmann::json j;
  j["step"] = step;
  std::vector<std::pair<std::string, float>> tb;
  for (const auto& [key, value] : scalars) {
    j[key] = value;  // non-finite: null
    if (std::isfinite(value)) tb.emplace_back(key, static_cast<float>(value));
  }
  if (tensorboard_) tensorboard_->write_scalars(step, tb);
  if (file_ != nullptr) write_line(j.dump());
}

std::vector<std::pair<std::string, float>> MetricsLogger::tensorboard_scalars(const StepMetrics& m) {
  std::vector<std::pair<std::string, float>> scalars;
  const auto add = [&](const std::string& key, double value) {
    if (std::isfinite(value)) scalars.emplace_back(key, static_cast<float>(value));
  };
  add("loss", m.loss);
  add("grad_norm", m.grad_norm);
  add("lr", m.lr);
  add("tps", m.tps);
  add("mfu", m.mfu);
  add("mem_peak_gib", m.mem_peak_gib);
  for (const auto& [key, value] : m.extra) add(key, value);
  for (const auto& [key, value] : m.file_only) add(key, value);
  return scalars;
}

std::filesystem::path MetricsLogger::tensorboard_folder() const {
  return tensorboard_ ? tensorboard_->path().parent_path() : std::filesystem::path();
}

std::filesystem::path MetricsLogger::tensorboard_file() const {
  return tensorboard_ ? tensorboard_->path() : std::filesystem::path();
}

}  // namespace loom::train
