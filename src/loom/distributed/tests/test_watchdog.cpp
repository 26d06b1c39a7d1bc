// The collective watchdog in one process, against its own FlightRecorder: which collectives count
// as stalled, the report, the thread's lifecycle, and the default handler's exit (a death test).
// The multi-rank behaviour (a rank that never joins, the launcher restarting) is in test_restart.cpp.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include <fstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/distributed/watchdog.h"
#include "loom/testing/run.h"

namespace {

using namespace loom::distributed;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

FlightRecord all_reduce_record(uint64_t group_seq, Clock::time_point started) {
  FlightRecord r;
  r.op = CommOp::kAllReduce;
  r.group = "world[0,1]";
  r.group_seq = group_seq;
  r.input_shape = {4};
  r.output_shape = {4};
  r.dtype = at::kFloat;
  r.payload_bytes = 16;
  r.started_at = std::chrono::system_clock::now();
  r.started_steady = started;
  return r;
}

// Collects the stalls a watchdog reports, instead of exiting.
struct StallLog {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<CollectiveStall> stalls;

  CollectiveWatchdog::StallHandler handler() {
    return [this](const CollectiveStall& s) {
      std::lock_guard<std::mutex> lock(mutex);
      stalls.push_back(s);
      changed.notify_all();
    };
  }
  bool wait_for_one(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mutex);
    return changed.wait_for(lock, limit, [&] { return !stalls.empty(); });
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(mutex);
    return stalls.size();
  }
};

TEST(Watchdog, PollIntervalAndBackendTimeoutFollowTheTimeout) {
  EXPECT_EQ(watchdog_poll_interval(2s), 100ms);
  EXPECT_EQ(watchdog_poll_interval(300s), 1s);    // capped
  EXPECT_EQ(watchdog_poll_interval(200ms), 50ms);  // floored
  // The backend gives up later than the watchdog, so the watchdog's report (with the dump) wins.
  EXPECT_EQ(backend_timeout_for(2s), 3200ms);
  EXPECT_EQ(backend_timeout_for(300s), 303s);
}

TEST(Watchdog, OnlyTheOldestCollectivePendingPastTheTimeoutIsAStall) {
  FlightRecorder recorder;
  StallLog log;
  CollectiveWatchdog watchdog(2s, recorder, log.handler());
  const Clock::time_point t0 = Clock::now();
  EXPECT_FALSE(watchdog.check(t0 + 1h).has_value()) << "no collective in flight";

  const uint64_t first = recorder.start(all_reduce_record(7, t0));
  recorder.start(all_reduce_record(8, t0 + 500ms));
  EXPECT_FALSE(watchdog.check(t0 + 1900ms).has_value()) << "younger than the timeout";
  std::optional<CollectiveStall> stall = watchdog.check(t0 + 3s);
  ASSERT_TRUE(stall.has_value());
  EXPECT_EQ(stall->record.group_seq, 7u);
  EXPECT_EQ(stall->age, 3s);
  EXPECT_EQ(stall->timeout, 2s);

  // Once the first finishes, the second is the oldest in flight; finished ones never stall.
  recorder.finish(first, true);
  stall = watchdog.check(t0 + 3s);
  ASSERT_TRUE(stall.has_value());
  EXPECT_EQ(stall->record.group_seq, 8u);
  EXPECT_EQ(stall->age, 2500ms);
  recorder.clear();
  EXPECT_FALSE(watchdog.check(t0 + 1h).has_value());
}

TEST(Watchdog, ReportNamesTheCollectiveItsAgeAndTheTimeout) {
  const Clock::time_point t0 = Clock::now();
  const CollectiveStall stall{all_reduce_record(7, t0), 3s, 2s};
  EXPECT_EQ(describe(stall),
            "collective watchdog: all_reduce world[0,1] gseq=7 in=[4] out=[4] Float 16B has been "
            "pending for 3.00 s, past the collective timeout of 2.00 s "
            "(comm.timeout_seconds); exiting with code 124 so the launcher stops (and may "
            "restart) the job");
}

TEST(Watchdog, ThreadReportsAStallOnceAndHonoursANewTimeout) {
  FlightRecorder recorder;
  StallLog log;
  CollectiveWatchdog watchdog(1h, recorder, log.handler());
  recorder.start(all_reduce_record(3, Clock::now()));
  // Not stalled under the hour-long timeout; shortening it applies to the collective in flight.
  EXPECT_FALSE(log.wait_for_one(300ms));
  watchdog.set_timeout(100ms);
  EXPECT_EQ(watchdog.timeout(), 100ms);
  ASSERT_TRUE(log.wait_for_one(10s)) << "the watchdog never reported the stalled all_reduce";
  std::this_thread::sleep_for(300ms);  // several more polls
  EXPECT_EQ(log.count(), 1u);
  std::lock_guard<std::mutex> lock(log.mutex);
  EXPECT_EQ(log.stalls[0].record.op, CommOp::kAllReduce);
  EXPECT_EQ(log.stalls[0].record.group_seq, 3u);
  EXPECT_GT(log.stalls[0].age, 100ms);
}

TEST(Watchdog, StopsPromptlyAndRejectsNonPositiveTimeouts) {
  FlightRecorder recorder;
  const Clock::time_point start = Clock::now();
  { CollectiveWatchdog watchdog(1h, recorder, [](const CollectiveStall&) {}); }
  EXPECT_LT(Clock::now() - start, 900ms) << "the destructor waited out a poll interval";
  EXPECT_THROW(CollectiveWatchdog(0ms, recorder), loom::UsageError);
  CollectiveWatchdog watchdog(1s, recorder, [](const CollectiveStall&) {});
  EXPECT_THROW(watchdog.set_timeout(-1ms), loom::UsageError);
}

TEST(FlightRecorder, FirstFinishWins) {
  // The backend's completion callback and the caller's wait() both finish a record; the first one
  // (the backend's, with the true duration) stands.
  FlightRecorder recorder;
  const uint64_t seq = recorder.start(all_reduce_record(1, Clock::now()));
  recorder.finish(seq, true);
  const auto duration = recorder.records()[0].duration;
  recorder.finish(seq, false);
  EXPECT_EQ(recorder.records()[0].state, FlightRecord::State::kCompleted);
  EXPECT_EQ(recorder.records()[0].duration, duration);
}

TEST(FlightRecorder, DumpFileIsJsonOfTheRingWrittenOnceWithTheFirstReason) {
  loom::testing::TempDir dir("flight");
  FlightRecorder recorder(2);
  EXPECT_FALSE(recorder.dump_to_file("no file set yet")) << "written with no dump file";
  recorder.finish(recorder.start(all_reduce_record(1, Clock::now())), true);
  recorder.finish(recorder.start(all_reduce_record(2, Clock::now())), true);
  recorder.start(all_reduce_record(3, Clock::now() - 1500ms));  // rotates gseq 1 out
  const auto path = dir.path() / "flight_recorder" / "rank0.json";
  recorder.set_dump_file(path);
  EXPECT_EQ(recorder.dump_file(), path);
  EXPECT_TRUE(recorder.dump_to_file("collective watchdog: the first reason"));
  EXPECT_FALSE(recorder.dump_to_file("a later echo")) << "the first reason must stand";
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  EXPECT_EQ(doc.at("reason"), "collective watchdog: the first reason");
  EXPECT_EQ(doc.at("capacity"), 2);
  const auto& records = doc.at("records");
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].at("group_seq"), 2);
  EXPECT_EQ(records[0].at("state"), "completed");
  EXPECT_GE(records[0].at("duration_ms").get<double>(), 0.0);
  const nlohmann::json& pending = records[1];
  EXPECT_EQ(pending.at("state"), "pending");
  EXPECT_GE(pending.at("pending_ms").get<double>(), 1500.0);
  EXPECT_EQ(pending.at("op"), "all_reduce");
  EXPECT_EQ(pending.at("group"), "world[0,1]");
  EXPECT_EQ(pending.at("group_seq"), 3);
  EXPECT_EQ(pending.at("dtype"), "Float");
  EXPECT_EQ(pending.at("input_shape"), nlohmann::json::array({4}));
  EXPECT_EQ(pending.at("payload_bytes"), 16);
  EXPECT_EQ(pending.at("description"), "all_reduce world[0,1] gseq=3 in=[4] out=[4] Float 16B");
  EXPECT_LT(records[0].at("seq").get<int64_t>(), pending.at("seq").get<int64_t>());
}

TEST(WatchdogDeathTest, DefaultHandlerLogsTheStallAndTheDumpThenExits124) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FlightRecorder recorder;
        FlightRecord barrier = all_reduce_record(6, Clock::now());
        barrier.op = CommOp::kBarrier;
        recorder.finish(recorder.start(barrier), true);
        recorder.start(all_reduce_record(7, Clock::now()));
        CollectiveWatchdog watchdog(100ms, recorder);
        std::this_thread::sleep_for(30s);
      },
      ::testing::ExitedWithCode(kExitCollectiveTimeout),
      "error: collective watchdog: all_reduce world\\[0,1\\] gseq=7 .* has been pending for .*"
      "flight recorder of rank 0 .*barrier world\\[0,1\\] gseq=6 started .* completed in .*"
      "all_reduce world\\[0,1\\] gseq=7 in=\\[4\\] out=\\[4\\] Float 16B started .* PENDING for");
}

}  // namespace
