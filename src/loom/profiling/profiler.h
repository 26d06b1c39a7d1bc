// Profiling a training run, as TorchTitan's [profiling] section does it (its profiling.py):
//   - Profiler: libtorch's Kineto profiler (what torch.profiler drives from Python) on a schedule.
//     Every window of `freq` steps ends with `warmup` steps in which the profiler is prepared but
//     discards what it sees, then `active` recorded steps; after the window's last step each rank
//     writes <traces_folder>/iteration_<step>/rank<r>_trace.json, a Chrome trace (Perfetto,
//     chrome://tracing, HTA). Every ATen op is in it, and Loom's own ranges: at::RecordFunction
//     guards with the USER_SCOPE (RECORD_USER_SCOPE, torch.profiler.record_function from Python),
//     shown as "user_annotation" events: "loom::forward", "loom::backward", "loom::fsdp::all_gather",
//     "loom::fsdp::reduce_scatter", "loom::optimizer_step", "loom::checkpoint::stage", ...
//   - MemoryProfiler: on CUDA the caching allocator's history (torch.cuda.memory's
//     _record_memory_history / _dump_snapshot, the pickle that pytorch.org/memory_viz opens), dumped
//     at every multiple of `freq`; on the CPU, which has no such allocator, a timeline of every
//     step's time and the process's current and peak resident set size (VmRSS / VmHWM).
// The trainer calls step() after every training step; neither knows what a step does.
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace loom::profiling {

// What the profiler does during training step `step` (1-based), TorchTitan's schedule
// (torch.profiler.schedule(wait=freq - warmup - active, warmup, active) with the profiler's step
// count starting at the run's step): the last `active` steps of every window of `freq` steps are
// recorded, the `warmup` steps before them prepare the profiler.
enum class StepAction { kNone, kWarmup, kRecord };
const char* to_string(StepAction action);

struct TraceSchedule {
  int64_t freq = 10;
  int64_t warmup = 3;
  int64_t active = 1;

  // loom::UsageError unless freq >= warmup + active, active >= 1 and warmup >= 0.
  void validate() const;
  StepAction action(int64_t step) const;
  // A window (and its trace) ends after this step.
  bool ends_window(int64_t step) const { return step % freq == 0; }
};

struct ProfilerOptions {
  std::filesystem::path traces_folder;  // <dump_folder>/<profiling.save_traces_folder>
  int rank = 0;
  int world_size = 1;
  TraceSchedule schedule;
  // The rank's compute device: a CUDA rank also records its kernels (Kineto's CUPTI activity).
  c10::Device device = c10::Device(c10::kCPU);
};

// The trace of the window that ended after `step`: <folder>/iteration_<step>/rank<rank>_trace.json.
std::filesystem::path trace_path(const std::filesystem::path& traces_folder, int64_t step, int rank);

// Kineto traces on a TraceSchedule. One per process: libtorch has one Kineto profiler.
class Profiler {
 public:
  explicit Profiler(ProfilerOptions options);
  // Stops a recording still running without writing it (training was interrupted by an error).
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Before the first step with the step the run starts from (0, or the step it resumed at), then
  // after every step with the step just finished: writes the trace of a window that ended, and
  // sets the profiler up for the next step's action.
  void step(int64_t finished_step);
  // After the last step: a recording cut short by the end of the run is written as
  // iteration_<last_step> (as torch.profiler does when its context exits).
  void finish(int64_t last_step);

  // Every trace this rank wrote, oldest first.
  const std::vector<std::filesystem::path>& traces() const { return traces_; }

 private:
  enum class State { kIdle, kPrepared, kRecording };
  void prepare();
  void start_recording();
  // Stops recording; writes the trace as iteration_<step> when `save`.
  void stop_recording(int64_t step, bool save);

  ProfilerOptions options_;
  State state_ = State::kIdle;
  std::vector<std::filesystem::path> traces_;
};

struct MemoryProfilerOptions {
  std::filesystem::path folder;  // <dump_folder>/<profiling.save_memory_snapshot_folder>
  int rank = 0;
  int64_t freq = 10;  // CUDA snapshots and timeline rewrites at every multiple of it
  c10::Device device = c10::Device(c10::kCPU);
};

// One step of the CPU timeline.
struct RssSample {
  int64_t step = 0;
  double seconds = 0.0;      // the step's wall time, as the trainer measured it
  int64_t rss_bytes = 0;     // VmRSS after the step
  int64_t peak_rss_bytes = 0;  // VmHWM: the step's peak (reset after every sample)
};

// The CPU timeline's file: <folder>/rank<rank>_rss_timeline.json.
std::filesystem::path rss_timeline_path(const std::filesystem::path& folder, int rank);
// The CUDA snapshot at `step`: <folder>/iteration_<step>/rank<rank>_memory_snapshot.pickle.
std::filesystem::path memory_snapshot_path(const std::filesystem::path& folder, int64_t step, int rank);

class MemoryProfiler {
 public:
  // On CUDA starts recording the allocator's history (TorchTitan's 100000 entries). On the CPU
  // resets the peak RSS, so the first sample's peak is the first step's.
  explicit MemoryProfiler(MemoryProfilerOptions options);
  ~MemoryProfiler();
  MemoryProfiler(const MemoryProfiler&) = delete;
  MemoryProfiler& operator=(const MemoryProfiler&) = delete;

  // After every step, with its wall time. On the CPU takes a sample and resets the peak RSS, so a
  // caller that reports a peak over several steps must read it (memory::peak_bytes) before this.
  void step(int64_t step, double seconds);
  // After the last step: the final snapshot / timeline.
  void finish(int64_t last_step);

  const std::vector<RssSample>& samples() const { return samples_; }

 private:
  void write_timeline() const;
  void dump_cuda_snapshot(int64_t step) const;

  MemoryProfilerOptions options_;
  std::vector<RssSample> samples_;
  int64_t last_written_step_ = -1;
};

}  // namespace loom::profiling
