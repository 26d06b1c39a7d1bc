#include "loom/profiling/profiler.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <fstream>
#include <set>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/memory.h"
#include "loom/core/torch_compat.h"
#include "loom/core/timer.h"

#ifdef LOOM_WITH_CUDA
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

namespace loom::profiling {
namespace fs = std::filesystem;
namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

namespace {

// TorchTitan's MEMORY_SNAPSHOT_MAX_ENTRIES: allocator events kept in the CUDA history.
constexpr size_t kMemoryHistoryEntries = 100000;

ProfilerConfig kineto_config() {
  // Shapes as TorchTitan records them (record_shapes=True); no stacks (no Python frames here) and
  // no allocation events (the memory profiler covers memory).
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/true,
                        /*profile_memory=*/false, /*with_stack=*/false, /*with_flops=*/false,
                        /*with_modules=*/false);
}

std::set<ActivityType> activities(const c10::Device& device) {
  std::set<ActivityType> out{ActivityType::CPU};
  if (device.is_cuda()) out.insert(ActivityType::CUDA);
  return out;
}

// Writes `text` to `path` through a temporary file in the same folder, so a reader (or a run
// killed mid-write) never sees half a file.
void write_atomically(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    LOOM_REQUIRE(static_cast<bool>(out), "cannot write '", tmp.string(), "'");
  }
  fs::rename(tmp, path);
}

}  // namespace

const char* to_string(StepAction action) {
  switch (action) {
    case StepAction::kNone: return "none";
    case StepAction::kWarmup: return "warmup";
    case StepAction::kRecord: return "record";
  }
  return "?";
}

void TraceSchedule::validate() const {
  LOOM_REQUIRE_USAGE(active >= 1, "profiling.profiler_active must be >= 1, got ", active);
  LOOM_REQUIRE_USAGE(warmup >= 0, "profiling.profiler_warmup must be >= 0, got ", warmup);
  LOOM_REQUIRE_USAGE(freq >= warmup + active, "profiling.profile_freq = ", freq,
                     " is shorter than profiling.profiler_warmup + profiling.profiler_active = ",
                     warmup + active, "; set profiling.profile_freq to at least ", warmup + active);
}

StepAction TraceSchedule::action(int64_t step) const {
  // Step k runs under torch.profiler's schedule at step count k - 1.
  const int64_t in_window = (step - 1) % freq;
  if (in_window >= freq - active) return StepAction::kRecord;
  if (in_window >= freq - active - warmup) return StepAction::kWarmup;
  return StepAction::kNone;
}

fs::path trace_path(const fs::path& traces_folder, int64_t step, int rank) {
  return traces_folder / c10::str("iteration_", step) / c10::str("rank", rank, "_trace.json");
}

Profiler::Profiler(ProfilerOptions options) : options_(std::move(options)) {
  options_.schedule.validate();
  fs::create_directories(options_.traces_folder);
  if (options_.rank == 0) {
    log::info("profiling: ", options_.schedule.active, " step(s) recorded after ",
              options_.schedule.warmup, " warm-up step(s) in every ", options_.schedule.freq,
              "; traces in ", options_.traces_folder.string());
  }
}

Profiler::~Profiler() {
  if (state_ == State::kIdle) return;
  try {
    if (state_ == State::kPrepared) kineto::enableProfiler(kineto_config(), activities(options_.device));
    kineto::disableProfiler();
  } catch (const std::exception&) {
    // Unwinding from another error: the trace is lost, the error that stopped training is not.
  }
}

void Profiler::prepare() {
  kineto::prepareProfiler(kineto_config(), activities(options_.device));
  state_ = State::kPrepared;
}

void Profiler::start_recording() {
  if (state_ == State::kIdle) prepare();
  kineto::enableProfiler(kineto_config(), activities(options_.device));
  // What torch.profiler adds for distributed runs, so trace tools (HTA) know the rank.
  nlohmann::json info = {{"backend", options_.device.is_cuda() ? "nccl" : "gloo"},
                         {"rank", options_.rank},
                         {"world_size", options_.world_size}};
  kineto::addMetadataJson("distributedInfo", info.dump());
  state_ = State::kRecording;
}

void Profiler::stop_recording(int64_t step, bool save) {
  std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
  state_ = State::kIdle;
  if (!save || !result) return;
  const Timer timer;
  const fs::path path = trace_path(options_.traces_folder, step, options_.rank);
  fs::create_directories(path.parent_path());
  result->save(path.string());
  LOOM_REQUIRE(fs::exists(path), "the profiler did not write its trace '", path.string(), "'");
  traces_.push_back(path);
  if (options_.rank == 0) {
    log::info("profiling: step ", step, " trace written to ", path.parent_path().string(), " (",
              timer.seconds(), " s)");
  }
}

void Profiler::step(int64_t finished_step) {
  const TraceSchedule& s = options_.schedule;
  if (state_ == State::kRecording && finished_step > 0 && s.ends_window(finished_step)) {
    stop_recording(finished_step, /*save=*/true);
  }
  switch (s.action(finished_step + 1)) {
    case StepAction::kNone:
      break;
    case StepAction::kWarmup:
      if (state_ == State::kIdle) prepare();
      break;
    case StepAction::kRecord:
      if (state_ != State::kRecording) start_recording();
      break;
  }
}

void Profiler::finish(int64_t last_step) {
  if (state_ == State::kRecording) {
    stop_recording(last_step, /*save=*/true);
  } else if (state_ == State::kPrepared) {
    // Warm-up reached but no recorded step: torch.profiler starts and stops the trace to release
    // what prepare set up, and writes nothing.
    start_recording();
    stop_recording(last_step, /*save=*/false);
  }
}

// ---------------------------------------------------------------------------------------------
// Memory

fs::path rss_timeline_path(const fs::path& folder, int rank) {
  return folder / c10::str("rank", rank, "_rss_timeline.json");
}

fs::path memory_snapshot_path(const fs::path& folder, int64_t step, int rank) {
  return folder / c10::str("iteration_", step) / c10::str("rank", rank, "_memory_snapshot.pickle");
}

MemoryProfiler::MemoryProfiler(MemoryProfilerOptions options) : options_(std::move(options)) {
  LOOM_REQUIRE_USAGE(options_.freq >= 1, "profiling.profile_freq must be >= 1, got ", options_.freq);
  fs::create_directories(options_.folder);
  if (options_.device.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    // Allocations, frees and segment events with their (C++-only, hence empty) Python context:
    // stacks="python" keeps the per-allocation cost at a timestamp, where "all" would unwind and
    // symbolize a C++ stack for every allocation.
    torch::cuda::_record_memory_history(std::optional<std::string>("all"),
                                        std::optional<std::string>("all"), "python",
                                        kMemoryHistoryEntries);
#else
    fail("profiling.enable_memory_snapshot on ", options_.device.str(),
         ": this Loom was built without CUDA (LOOM_WITH_CUDA)");
#endif
  } else {
    LOOM_REQUIRE_USAGE(options_.device.is_cpu(), "profiling.enable_memory_snapshot supports CUDA "
                       "and CPU runs, not ", options_.device.str(), "; set it to false");
    memory::reset_peak_rss();
  }
  if (options_.rank == 0) log::info("memory profiling: ", options_.folder.string());
}

MemoryProfiler::~MemoryProfiler() {
#ifdef LOOM_WITH_CUDA
  if (options_.device.is_cuda()) {
    try {
      torch::cuda::_record_memory_history(std::optional<std::string>(), std::optional<std::string>(),
                                          "python", kMemoryHistoryEntries);
    } catch (const std::exception&) {
      // Only stops the recording; nothing to report while the process ends.
    }
  }
#endif
}

void MemoryProfiler::step(int64_t step, double seconds) {
  if (options_.device.is_cpu()) {
    samples_.push_back({step, seconds, memory::current_rss_bytes(), memory::peak_rss_bytes()});
    memory::reset_peak_rss();  // the next sample's peak is the next step's
  }
  if (step % options_.freq == 0) {
    if (options_.device.is_cpu()) {
      write_timeline();
    } else {
      dump_cuda_snapshot(step);
    }
    last_written_step_ = step;
  }
}

void MemoryProfiler::finish(int64_t last_step) {
  if (last_step == last_written_step_) return;
  if (options_.device.is_cpu()) {
    write_timeline();
  } else {
    dump_cuda_snapshot(last_step);
  }
  last_written_step_ = last_step;
}

void MemoryProfiler::write_timeline() const {
  nlohmann::json steps = nlohmann::json::array();
  for (const RssSample& s : samples_) {
    steps.push_back({{"step", s.step},
                     {"seconds", s.seconds},
                     {"rss_bytes", s.rss_bytes},
                     {"peak_rss_bytes", s.peak_rss_bytes}});
  }
  const nlohmann::json doc = {
      {"rank", options_.rank},
      {"pid", static_cast<int64_t>(::getpid())},
      {"device", options_.device.str()},
      {"description", "per step: wall seconds, resident set size after the step (VmRSS) and its "
                      "peak during the step (VmHWM, reset after each step)"},
      {"steps", steps}};
  write_atomically(rss_timeline_path(options_.folder, options_.rank), doc.dump(1) + "\n");
}

void MemoryProfiler::dump_cuda_snapshot(int64_t step) const {
#ifdef LOOM_WITH_CUDA
  const fs::path path = memory_snapshot_path(options_.folder, step, options_.rank);
  write_atomically(path, torch::cuda::_memory_snapshot_pickled());
  if (options_.rank == 0) log::info("memory snapshot at step ", step, ": ", path.string());
#else
  fail("CUDA memory snapshot at step ", step, " in a build without CUDA (LOOM_WITH_CUDA)");
#endif
}

}  // namespace loom::profiling
