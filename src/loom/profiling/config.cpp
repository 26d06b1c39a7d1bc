#include "loom/profiling/config.h"

namespace loom::profiling {

namespace {
void check(const ProfilingConfig& p) {
  const options::Section& s = profiling_section();
  options::require(!p.save_traces_folder.empty(), s, "save_traces_folder", "a non-empty path", &p);
  options::require(!p.save_memory_snapshot_folder.empty(), s, "save_memory_snapshot_folder", "a non-empty path", &p);
  options::require(p.profiler_active >= 1, s, "profiler_active", ">= 1", &p);
  options::require(p.profiler_warmup >= 0, s, "profiler_warmup", ">= 0", &p);
  options::require(p.profile_freq >= 1, s, "profile_freq", ">= 1", &p);
  // The window's warm-up and recorded steps exist only when the profiler runs: a memory snapshot
  // alone (enable_memory_snapshot) uses profile_freq as its period and nothing else.
  LOOM_REQUIRE_USAGE(!p.enable_profiling || p.profile_freq >= p.profiler_warmup + p.profiler_active,
                     "profiling.profile_freq = ", p.profile_freq, " is shorter than profiling.profiler_warmup + "
                     "profiling.profiler_active = ", p.profiler_warmup, " + ", p.profiler_active,
                     " (each window of profile_freq steps holds the warm-up and the recorded steps); set "
                     "profiling.profile_freq to at least ", p.profiler_warmup + p.profiler_active);
}
}  // namespace

const options::Section& profiling_section() {
  using S = ProfilingConfig;
  static const options::Section section{
      "profiling",
      {
          {LOOM_OPTION(S, enable_profiling),
           "Record Kineto (PyTorch profiler) traces: in every window of `profile_freq` steps, "
           "`profiler_warmup` steps of warm-up then `profiler_active` recorded steps, written after the "
           "window's last step as `<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json` "
           "(Chrome trace JSON: open in Perfetto or chrome://tracing). See docs/profiling.md."},
          {LOOM_OPTION(S, save_traces_folder), "Trace folder, relative to `job.dump_folder`."},
          {LOOM_OPTION(S, profile_freq),
           "Length of a profiling window in steps; the traces (and memory snapshots) are written at "
           "every multiple of it. At least `profiler_warmup + profiler_active`."},
          {LOOM_OPTION(S, profiler_active), "Steps recorded at the end of each window (>= 1)."},
          {LOOM_OPTION(S, profiler_warmup),
           "Steps before the recorded ones during which the profiler is set up but discards its "
           "events, so that its start-up cost stays out of the trace (>= 0)."},
          {LOOM_OPTION(S, enable_memory_snapshot),
           "Record memory. On CUDA: the caching allocator's history, dumped at every multiple of "
           "`profile_freq` (and at the end) as `iteration_<step>/rank<r>_memory_snapshot.pickle`, the "
           "format of `torch.cuda.memory._dump_snapshot` (open in pytorch.org/memory_viz). On the CPU: "
           "`rank<r>_rss_timeline.json`, every step's time and current and peak resident set size, "
           "rewritten at every multiple of `profile_freq` and at the end."},
          {LOOM_OPTION(S, save_memory_snapshot_folder), "Memory snapshot folder, relative to `job.dump_folder`."},
      },
      {},
      {},
      &options::validate_as<S, check>};
  return section;
}

}  // namespace loom::profiling
