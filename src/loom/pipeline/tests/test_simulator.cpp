// The simulator: deadlocks and mismatched messages named, costs, timeline, Chrome trace.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/pipeline/generators.h"
#include "loom/pipeline/simulator.h"
#include "loom/testing/errors.h"
#include "loom/testing/run.h"

namespace {
using namespace loom::pipeline;
using loom::UsageError;
using loom::testing::expect_error;

TEST(PipelineSimulator, LoweredScheduleThatDeadlocksNamesEachRanksStuckAction) {
  // Rank 0 waits for micro-batch 0's gradient before it sends micro-batch 1's activations, while
  // rank 1 runs micro-batch 1 first: a cycle, although every message has its partner, in order.
  const Schedule s = schedule_from_csv_text(
      "0F0,0SEND_F0,0RECV_B1,0RECV_B0,0B0,0F1,0SEND_F1,0B1\n"
      "1RECV_F0,1RECV_F1,1F1,1B1,1SEND_B1,1F0,1B0,1SEND_B0\n",
      "cycle.csv");
  for (SendMode mode : {SendMode::kAsync, SendMode::kRendezvous}) {
    SimulationOptions o;
    o.send_mode = mode;
    expect_error<UsageError>([&] { simulate(s, o); },
                             {"cycle.csv: schedule deadlocks: rank 0 waits at 0B0 for 1SEND_B0 (rank 1), "
                              "rank 1 waits at 1F1 for 0SEND_F1 (rank 0)"});
  }
}

TEST(PipelineSimulator, ReceiveThatNoRankSends) {
  expect_error<UsageError>(
      [] {
        simulate(schedule_from_csv_text("0F0,0SEND_F0,0F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
                                        "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n",
                                        "lost.csv"));
      },
      {"lost.csv: schedule deadlocks: rank 1 waits at 1RECV_F1, which no rank sends (rank 0 has no 0SEND_F1)"});
}

TEST(PipelineSimulator, MessagesBetweenTwoRanksMatchInPostingOrder) {
  expect_error<UsageError>(
      [] {
        simulate(schedule_from_csv_text("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
                                        "1RECV_F1,1RECV_F0,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n",
                                        "order.csv"));
      },
      {"order.csv: rank 1's 1st receive from rank 0 is 1RECV_F1 but rank 0's 1st send to rank 1 is 0SEND_F0",
       "match in the order they are posted"});
}

TEST(PipelineSimulator, ComputeOnlyScheduleAcrossRanksMustBeLowered) {
  expect_error<UsageError>([] { simulate(generate_compute({"1F1B", 2, 2})); },
                           {"has no send/recv actions but its stages span ranks", "add_communication"});
  // One rank needs no communication.
  EXPECT_EQ(simulate(generate_compute({"Interleaved1F1B", 1, 4, 2})).makespan, 24);
}

TEST(PipelineSimulator, Timeline) {
  const SimulationResult r = simulate(build_schedule({"1F1B", 2, 2}));
  // rank 1: F0 [1,2), B0 [2,4), F1 [4,5), B1 [5,7); rank 0: F0 [0,1), F1 [1,2), B0 [4,6), B1 [7,9).
  auto compute = [&](int rank) {
    std::string out;
    for (const TimedAction& t : r.timeline[rank]) {
      if (!is_compute(t.action.kind)) continue;
      out += t.action.str() + "@" + std::to_string(int(t.start)) + "-" + std::to_string(int(t.end)) + " ";
    }
    return out;
  };
  EXPECT_EQ(compute(0), "0F0@0-1 0F1@1-2 0B0@4-6 0B1@7-9 ");
  EXPECT_EQ(compute(1), "1F0@1-2 1B0@2-4 1F1@4-5 1B1@5-7 ");
  EXPECT_EQ(r.makespan, 9);
  EXPECT_EQ(r.compute_time, (std::vector<double>{6, 6}));
  EXPECT_EQ(r.idle_time, (std::vector<double>{3, 3}));
  EXPECT_NEAR(r.bubble_fraction, 1.0 / 3.0, 1e-12);
  EXPECT_EQ(format_summary(r),
            "makespan 9, bubble fraction 0.3333\n"
            "rank  compute  idle     peak activations\n"
            "0     6        3        2\n"
            "1     6        3        1\n");
}

TEST(PipelineSimulator, CallerGivenCosts) {
  const Costs c = Costs::parse("F=1,B=2,transfer=0.5,Send=0.25");
  EXPECT_EQ(c.forward, 1);
  EXPECT_EQ(c.backward, 2);
  EXPECT_EQ(c.transfer, 0.5);
  EXPECT_EQ(c.send, 0.25);
  EXPECT_EQ(c.backward_input, 1);  // untouched default
  EXPECT_EQ(Costs::parse(c.str()).str(), c.str());
  expect_error<UsageError>([] { Costs::parse("X=1"); }, {"unknown cost 'X'", "valid: F, B, I, W"});
  expect_error<UsageError>([] { Costs::parse("F=-1"); }, {"non-negative number"});
  expect_error<UsageError>([] { Costs::parse("F"); }, {"is not KEY=VALUE"});

  // GPipe with a transfer time t per hop: (m + pp - 1)(f + b) + 2 (pp - 1) t.
  for (int pp : {2, 4}) {
    for (int m : {4, 8}) {
      SimulationOptions o;
      o.costs = Costs::parse("F=1,B=2,transfer=0.5");
      const SimulationResult r = simulate(build_schedule({"GPipe", pp, m}), o);
      EXPECT_DOUBLE_EQ(r.makespan, (m + pp - 1) * 3.0 + 2 * (pp - 1) * 0.5);
    }
  }
  // Backward twice the forward, split evenly into I and W: the zero-bubble schedules keep their
  // (pp - 1) ramp when W fills the gaps.
  SimulationOptions o;
  o.costs = Costs::parse("F=2,B=4,I=2,W=2");
  EXPECT_DOUBLE_EQ(simulate(build_schedule({"ZBVZeroBubble", 4, 8}), o).makespan, 2 * (6.0 * 8 + 3));
}

TEST(PipelineSimulator, ChromeTraceParsesWithOneEventPerAction) {
  const loom::testing::TempDir dir("pp-trace");
  for (const std::string& name : schedule_names()) {
    SCOPED_TRACE(name);
    const Schedule s = build_schedule({name, 4, 8}, /*fsdp=*/true);
    const SimulationResult r = simulate(s);
    const std::string path = dir.str() + "/" + name + ".json";
    write_chrome_trace(r, path);
    std::ifstream in(path);
    const nlohmann::json trace = nlohmann::json::parse(in);
    ASSERT_TRUE(trace.contains("traceEvents"));
    size_t complete = 0, metadata = 0;
    std::set<int> tids;
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] == "M") {
        ++metadata;
        continue;
      }
      ASSERT_EQ(e["ph"], "X");
      ++complete;
      tids.insert(e["tid"].get<int>());
      EXPECT_GE(e["dur"].get<double>(), 0);
      EXPECT_GE(e["ts"].get<double>(), 0);
      EXPECT_FALSE(e["name"].get<std::string>().empty());
    }
    EXPECT_EQ(complete, s.num_actions());
    EXPECT_EQ(metadata, 4u);
    EXPECT_EQ(tids, (std::set<int>{0, 1, 2, 3}));
    EXPECT_DOUBLE_EQ(trace["otherData"]["bubble_fraction"].get<double>(), r.bubble_fraction);
  }
  expect_error<UsageError>([] { write_chrome_trace(SimulationResult{}, "/nonexistent-dir/x.json"); },
                           {"cannot write the trace file"});
}

}  // namespace
