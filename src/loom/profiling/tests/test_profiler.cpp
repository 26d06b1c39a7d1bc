// The profiling folder in one process: TorchTitan's trace schedule, Kineto traces written as
// Chrome-trace JSON with Loom's named ranges in them, and the CPU's RSS timeline. The multi-rank
// run through `loom train` is in src/loom/train/tests/test_trainer_profiling.cpp.
#include <gtest/gtest.h>

#include <ATen/record_function.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/profiling/profiler.h"
#include "loom/testing/run.h"

namespace {

using namespace loom::profiling;
namespace fs = std::filesystem;
using loom::testing::TempDir;

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The names of the trace's events of category `category` ("user_annotation": RecordFunction
// ranges of the user scope; "cpu_op": ATen operators).
std::multiset<std::string> event_names(const nlohmann::json& trace, const std::string& category) {
  std::multiset<std::string> names;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("cat", "") == category) names.insert(e.value("name", ""));
  }
  return names;
}

// One "training step" of the tests: a named range around a matmul.
void fake_step(int64_t step) {
  RECORD_USER_SCOPE(c10::str("test::step", step));
  const at::Tensor a = at::ones({32, 32});
  (void)at::mm(a, a).sum().item<float>();
}

TEST(TraceSchedule, RecordsTheLastActiveStepsOfEveryWindowAfterTheWarmup) {
  // TorchTitan's defaults: freq 10, warmup 3, active 1.
  const TraceSchedule s{10, 3, 1};
  std::string actions;
  for (int64_t step = 1; step <= 20; ++step) actions += to_string(s.action(step))[0];
  EXPECT_EQ(actions, "nnnnnnwwwrnnnnnnwwwr");
  EXPECT_TRUE(s.ends_window(10));
  EXPECT_FALSE(s.ends_window(9));
  // Every step recorded when the window is all active.
  const TraceSchedule all{2, 0, 2};
  for (int64_t step = 1; step <= 4; ++step) EXPECT_EQ(all.action(step), StepAction::kRecord);
  EXPECT_THROW((TraceSchedule{3, 3, 1}.validate()), loom::UsageError);
  EXPECT_THROW((TraceSchedule{3, 0, 0}.validate()), loom::UsageError);
  EXPECT_NO_THROW((TraceSchedule{4, 3, 1}.validate()));
}

TEST(Profiler, WritesOneChromeTracePerWindowWithTheRecordedStepsRanges) {
  TempDir dir("prof");
  ProfilerOptions options;
  options.traces_folder = dir.path() / "profile_traces";
  options.schedule = {3, 1, 1};  // step 2 warm-up, step 3 recorded; steps 5, 6 likewise
  Profiler profiler(options);
  profiler.step(0);
  for (int64_t step = 1; step <= 7; ++step) {
    fake_step(step);
    profiler.step(step);
  }
  profiler.finish(7);  // step 7 was not recorded: nothing more
  ASSERT_EQ(profiler.traces(), (std::vector<fs::path>{trace_path(options.traces_folder, 3, 0),
                                                       trace_path(options.traces_folder, 6, 0)}));
  EXPECT_EQ(trace_path(options.traces_folder, 3, 0),
            dir.path() / "profile_traces" / "iteration_3" / "rank0_trace.json");
  for (int64_t window_end : {3, 6}) {
    const nlohmann::json trace = read_json(trace_path(options.traces_folder, window_end, 0));
    const auto ranges = event_names(trace, "user_annotation");
    // Only the recorded step's range: the warm-up step's events are discarded.
    EXPECT_EQ(ranges, (std::multiset<std::string>{c10::str("test::step", window_end)}))
        << "window ending at step " << window_end;
    EXPECT_GT(event_names(trace, "cpu_op").count("aten::mm"), 0u);
    EXPECT_EQ(trace.at("distributedInfo").at("rank"), 0);
  }
}

TEST(Profiler, WritesARecordingCutShortByTheEndOfTheRun) {
  TempDir dir("prof");
  ProfilerOptions options;
  options.traces_folder = dir.path() / "traces";
  options.schedule = {4, 0, 2};  // steps 3 and 4 recorded; the run ends after step 3
  Profiler profiler(options);
  profiler.step(0);
  for (int64_t step = 1; step <= 3; ++step) {
    fake_step(step);
    profiler.step(step);
  }
  EXPECT_TRUE(profiler.traces().empty());
  profiler.finish(3);
  ASSERT_EQ(profiler.traces().size(), 1u);
  const auto ranges = event_names(read_json(trace_path(options.traces_folder, 3, 0)), "user_annotation");
  EXPECT_EQ(ranges, (std::multiset<std::string>{"test::step3"}));
}

TEST(MemoryProfiler, CpuTimelineHasEveryStepsTimeAndRssWithThePeakOfItsOwnStep) {
  TempDir dir("mem");
  MemoryProfilerOptions options;
  options.folder = dir.path() / "memory_snapshot";
  options.rank = 3;
  options.freq = 2;
  MemoryProfiler profiler(options);
  const fs::path path = rss_timeline_path(options.folder, 3);
  EXPECT_EQ(path, dir.path() / "memory_snapshot" / "rank3_rss_timeline.json");
  constexpr int64_t kBig = 256LL << 20;
  profiler.step(1, 0.25);
  EXPECT_FALSE(fs::exists(path)) << "written only at multiples of profile_freq";
  {
    // Step 2 touches 256 MiB and frees it again: its peak holds it, the RSS after it need not.
    at::Tensor big = at::ones({kBig / 4}, at::kFloat);
    ASSERT_EQ(big.sum().item<float>(), static_cast<float>(kBig / 4));
  }
  profiler.step(2, 0.5);
  ASSERT_TRUE(fs::exists(path));
  EXPECT_EQ(read_json(path).at("steps").size(), 2u);
  profiler.step(3, 0.125);
  profiler.finish(3);
  const nlohmann::json doc = read_json(path);
  EXPECT_EQ(doc.at("rank"), 3);
  const auto& steps = doc.at("steps");
  ASSERT_EQ(steps.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(steps[i].at("step"), i + 1);
    EXPECT_GT(steps[i].at("rss_bytes").get<int64_t>(), 0);
    EXPECT_GE(steps[i].at("peak_rss_bytes").get<int64_t>(), steps[i].at("rss_bytes").get<int64_t>());
  }
  EXPECT_EQ(steps[1].at("seconds"), 0.5);
  // The peak is reset after every sample: step 2's includes the 256 MiB, step 3's does not.
  const int64_t peak2 = steps[1].at("peak_rss_bytes"), peak3 = steps[2].at("peak_rss_bytes");
  EXPECT_GE(peak2, steps[0].at("rss_bytes").get<int64_t>() + kBig * 9 / 10);
  EXPECT_LT(peak3, peak2 - kBig / 2);
  std::printf("RSS timeline: step peaks %.1f, %.1f, %.1f MiB\n",
              steps[0].at("peak_rss_bytes").get<double>() / (1 << 20), peak2 / double(1 << 20),
              peak3 / double(1 << 20));
}

}  // namespace
