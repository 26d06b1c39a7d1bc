// Every generator over a grid of (pp, micro-batches, v): it runs without deadlock (both send
// models), every (stage, micro-batch) has its forward and backward, and at unit costs (F=1, B=2,
// I=W=1, free communication) the makespan is the analytical one:
//   GPipe, 1F1B, Interleaved1F1B, LoopedBFS (m >= pp):   3 (v m + pp - 1)
//       bubble (pp - 1) / (v m + pp - 1): (pp-1)/(m+pp-1) at v = 1
//   Interleaved1F1B, LoopedBFS with m < pp:            3 ((v - 1) pp + m + pp - 1)  (each loop
//       waits for the micro-batch to come round the ring)
//   InterleavedZeroBubble (m >= pp), ZBVZeroBubble (m >= 2pp - 1), DualPipeV:   3 v m + pp - 1
//       bubble (pp - 1) / (3 v m + pp - 1): only the ramp-up of the first forward remains
#include <gtest/gtest.h>

#include <string>

#include "loom/pipeline/generators.h"
#include "loom/pipeline/simulator.h"
#include "loom/testing/errors.h"

namespace {
using namespace loom::pipeline;
using loom::testing::expect_error;

struct Point {
  int pp, m, v;
};

std::vector<Point> grid(const std::string& name) {
  std::vector<Point> out;
  for (int pp : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 5, 6, 8, 12, 16}) {
      for (int v : {1, 2, 3, 4}) {
        if (!is_multi_stage(name) && v != 1) continue;
        if ((name == "ZBVZeroBubble" || name == "DualPipeV") && v != 2) continue;
        out.push_back({pp, m, v});
      }
    }
  }
  return out;
}

// What the generator accepts (the rules in generators.h).
bool accepted(const std::string& name, const Point& p) {
  if (name == "1F1B") return p.m >= p.pp;
  if (name == "Interleaved1F1B" || name == "InterleavedZeroBubble") return p.m % std::max(1, p.m / p.pp) == 0;
  if (name == "DualPipeV") return p.m >= 2 * p.pp;
  return true;
}

// The unit-cost makespan where a closed form holds (0 where the test does not claim one).
double expected_makespan(const std::string& name, const Point& p) {
  const int pp = p.pp, m = p.m, v = p.v;
  if (name == "GPipe" || name == "1F1B") return 3.0 * (m + pp - 1);
  if (name == "Interleaved1F1B" || name == "LoopedBFS") {
    return m >= pp ? 3.0 * (v * m + pp - 1) : 3.0 * ((v - 1) * pp + m + pp - 1);
  }
  if (name == "InterleavedZeroBubble" && m >= pp) return 3.0 * v * m + pp - 1;
  if (name == "ZBVZeroBubble" && m >= 2 * pp - 1) return 3.0 * v * m + pp - 1;
  if (name == "DualPipeV") return 3.0 * v * m + pp - 1;
  return 0;
}

TEST(PipelineGenerators, EveryScheduleRunsCompleteAndMatchesItsFormula) {
  int simulated = 0;
  for (const std::string& name : schedule_names()) {
    for (const Point& p : grid(name)) {
      SCOPED_TRACE(name + " pp=" + std::to_string(p.pp) + " m=" + std::to_string(p.m) + " v=" + std::to_string(p.v));
      if (!accepted(name, p)) {
        EXPECT_THROW(generate_compute({name, p.pp, p.m, p.v}), loom::UsageError);
        continue;
      }
      const Schedule compute = generate_compute({name, p.pp, p.m, p.v});
      EXPECT_EQ(compute.num_stages(), p.pp * p.v);
      if (name != "DualPipeV") {  // DualPipeV mixes B and I + W
        EXPECT_EQ(compute.num_actions(), static_cast<size_t>(p.pp * p.v * p.m * (splits_backward(name) ? 3 : 2)));
      }
      const Schedule s = add_communication(compute);  // throws on a compute order that deadlocks
      // Completeness (exactly one F and one B or I+W per stage and micro-batch) is validate()'s.
      EXPECT_NO_THROW(validate(s));
      for (SendMode mode : {SendMode::kAsync, SendMode::kRendezvous}) {
        SimulationOptions o;
        o.send_mode = mode;
        const SimulationResult r = simulate(s, o);
        ++simulated;
        const double work = 3.0 * p.v * p.m;  // per rank: F + B (or F + I + W) of v stages
        for (double c : r.compute_time) EXPECT_EQ(c, work);
        if (const double want = expected_makespan(name, p); want > 0) {
          EXPECT_EQ(r.makespan, want);
          EXPECT_NEAR(r.bubble_fraction, 1.0 - work / want, 1e-12);
        }
      }
    }
  }
  EXPECT_GT(simulated, 500);
}

TEST(PipelineGenerators, GPipeAnd1F1BBubbleIsTheTextbookFormula) {
  for (int pp : {2, 4, 8}) {
    for (int m : {8, 16}) {
      for (const char* name : {"GPipe", "1F1B"}) {
        const SimulationResult r = simulate(build_schedule({name, pp, m}));
        EXPECT_EQ(r.makespan, 3.0 * (m + pp - 1)) << name;
        EXPECT_NEAR(r.bubble_fraction, double(pp - 1) / (m + pp - 1), 1e-12) << name;
      }
    }
  }
}

TEST(PipelineGenerators, InterleavingShrinksTheBubbleByV) {
  for (int pp : {2, 4}) {
    for (int m : {4, 8, 16}) {
      const double one_f_one_b = simulate(build_schedule({"1F1B", pp, m})).bubble_fraction;
      for (int v : {2, 4}) {
        const double interleaved = simulate(build_schedule({"Interleaved1F1B", pp, m, v})).bubble_fraction;
        EXPECT_NEAR(interleaved, double(pp - 1) / (v * m + pp - 1), 1e-12);
        EXPECT_LT(interleaved, one_f_one_b);
      }
    }
  }
}

TEST(PipelineGenerators, ZeroBubbleSchedulesBeat1F1BAtEqualMicroBatches) {
  for (int pp : {2, 4, 8}) {
    for (int m : {2 * pp, 4 * pp}) {
      const double one_f_one_b = simulate(build_schedule({"1F1B", pp, m})).bubble_fraction;
      for (const char* name : {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}) {
        const double zb = simulate(build_schedule({name, pp, m})).bubble_fraction;
        EXPECT_LT(zb, one_f_one_b) << name << " pp=" << pp << " m=" << m;
        EXPECT_NEAR(zb, double(pp - 1) / (6.0 * m + pp - 1), 1e-12) << name;
      }
    }
  }
}

TEST(PipelineGenerators, PeakLiveActivations) {
  for (int pp : {2, 4, 8}) {
    for (int m : {pp, 2 * pp, 3 * pp}) {
      // GPipe holds every micro-batch on every rank; 1F1B at most pp - rank.
      const auto gpipe = simulate(build_schedule({"GPipe", pp, m})).peak_activations;
      const auto ofob = simulate(build_schedule({"1F1B", pp, m})).peak_activations;
      for (int r = 0; r < pp; ++r) {
        EXPECT_EQ(gpipe[r], m);
        EXPECT_EQ(ofob[r], pp - r);
      }
      EXPECT_LE(ofob[0], pp);
      // Looped BFS keeps every micro-batch of all v stages.
      EXPECT_EQ(simulate(build_schedule({"LoopedBFS", pp, m, 2})).peak_activations[0], 2 * m);
    }
  }
  // The I/W split keeps an activation until its W.
  const Schedule s = schedule_from_csv_text("0F0,0F1,0I0,0I1,0W0,0W1\n", "s");
  EXPECT_EQ(peak_activations(s), std::vector<int>{2});
  const Schedule t = schedule_from_csv_text("0F0,0I0,0W0,0F1,0I1,0W1\n", "t");
  EXPECT_EQ(peak_activations(t), std::vector<int>{1});
}

TEST(PipelineGenerators, RefusesWhatAScheduleCannotRun) {
  using loom::UsageError;
  expect_error<UsageError>([] { generate_compute({"1F1B", 4, 3}); },
                           {"1F1B needs at least as many micro-batches as stages (3 < 4)", "GPipe"});
  expect_error<UsageError>([] { generate_compute({"Interleaved1F1B", 4, 9, 2}); },
                           {"Interleaved1F1B needs the micro-batches to split into rounds of equal size",
                            "9 micro-batches at pp 4 make 2 rounds", "use 8 or 10 micro-batches"});
  expect_error<UsageError>([] { generate_compute({"InterleavedZeroBubble", 4, 13, 2}); },
                           {"InterleavedZeroBubble needs", "use 12 or 15"});
  expect_error<UsageError>([] { generate_compute({"DualPipeV", 4, 7}); },
                           {"DualPipeV needs at least as many micro-batches as stages (7 < 8 = 2 x pp 4)"});
  expect_error<UsageError>([] { generate_compute({"ZBVZeroBubble", 4, 8, 3}); },
                           {"ZBVZeroBubble needs exactly 2 stages per rank", "not 3"});
  expect_error<UsageError>([] { generate_compute({"GPipe", 4, 8, 2}); },
                           {"GPipe runs one stage per rank, not 2", "Interleaved1F1B"});
  expect_error<UsageError>([] { generate_compute({"GPipe", 4, 0}); }, {"at least 1 micro-batch"});
  expect_error<UsageError>([] { generate_compute({"Interleaved1F1", 4, 8}); },
                           {"unknown pipeline schedule 'Interleaved1F1'", "did you mean 'Interleaved1F1B'?"});
}

TEST(PipelineGenerators, CommunicationPassPlacesEachReceiveBeforeItsConsumer) {
  const Schedule s = build_schedule({"1F1B", 2, 2});
  EXPECT_EQ(format_actions(s),
            "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
            "rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1\n");
  // Stages next to each other on one rank (V-shape's turn) exchange nothing.
  const Schedule v = build_schedule({"ZBVZeroBubble", 2, 4});
  for (const Action& a : v.ranks[1]) {
    EXPECT_FALSE(a.kind == ActionKind::kSendF && a.stage == 1) << a.str();
    EXPECT_FALSE(a.kind == ActionKind::kSendB && a.stage == 2) << a.str();
  }
  // A compute order that cannot run is refused, naming what each rank waits for.
  expect_error<loom::UsageError>(
      [] { add_communication(schedule_from_csv_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "bad.csv")); },
      {"bad.csv: schedule deadlocks: rank 0 waits at 0B0 for 1B0 (rank 1), rank 1 waits at 1F1 for 0F1 (rank 0)"});
}

}  // namespace
