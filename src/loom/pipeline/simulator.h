// The schedule simulator: runs a lowered Schedule (with its SEND/RECV actions) on every rank at
// once with a cost per action, and proves it can run.
//
// Execution model (PyTorch's _PipelineScheduleRuntime): each rank runs its actions in order, one
// at a time. A RECV posts the receive and goes on (irecv); the compute that consumes it waits for
// the data, which is there when the matching SEND has run plus `transfer`. In kAsync mode a SEND
// posts the send and goes on (isend, waited at the end of the step). In kRendezvous mode a run of
// consecutive SEND/RECV actions is one batch (batch_isend_irecv): all its receives are posted when
// the rank reaches it, and the rank leaves it only when every send of the batch has met its posted
// receive — the stricter model of a transport whose sends block.
// Point-to-point messages between two ranks match in the order they are posted (NCCL's rule): the
// k-th receive rank d posts from rank s must be the k-th send from s to d.
//
// Dependencies: F(s,m) needs F(s-1,m); B/I(s,m) needs F(s,m) and B/I(s+1,m); W(s,m) needs I(s,m);
// across ranks through the SEND/RECV pair, on one rank directly.
//
// Failures (UsageError, one line): a receive no rank sends ("schedule deadlocks: rank 1 waits at
// 1RECV_F2, which no rank sends"), messages matched out of order, and a deadlock naming the first
// stuck action of every rank and what it waits for.
#pragma once
#include <string>
#include <vector>

#include "loom/pipeline/schedule.h"

namespace loom::pipeline {

struct Costs {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1;
  double send = 0, recv = 0;  // time a SEND / RECV occupies its rank (posting it)
  double transfer = 0;        // from the end of a SEND to the data being usable by the receiver
  double unshard = 0, reshard = 0, reduce_grad = 0;  // issuing FSDP's collectives (they run async)
  double of(ActionKind kind) const;
  // "F=1,B=2,I=1,W=1,send=0,recv=0,transfer=0,unshard=0,reshard=0,reduce_grad=0" (any subset,
  // case-insensitive).
  static Costs parse(const std::string& text);
  std::string str() const;
};

enum class SendMode { kAsync, kRendezvous };

struct SimulationOptions {
  Costs costs;
  SendMode send_mode = SendMode::kAsync;
};

struct TimedAction {
  Action action;
  double start = 0, end = 0;
};

struct SimulationResult {
  std::string schedule_name;
  int num_ranks = 0;
  double makespan = 0;                      // end of the last action on any rank
  double bubble_fraction = 0;               // 1 - sum of compute time / (ranks x makespan)
  std::vector<double> compute_time;         // per rank: time in F, B, I, W
  std::vector<double> idle_time;            // per rank: makespan - compute_time
  // Per rank: the largest number of (stage, micro-batch) activations held at once. An activation
  // of (s, m) is live from the start of F(s,m) until the end of B(s,m), or, when the backward is
  // split, until the end of W(s,m) (the weight gradient still needs the stage's saved inputs).
  std::vector<int> peak_activations;
  std::vector<std::vector<TimedAction>> timeline;  // per rank, in execution order
};

// Validates the schedule (validate()), requires its communication when stages cross ranks, checks
// the send/recv matching, and simulates it.
SimulationResult simulate(const Schedule& schedule, const SimulationOptions& options = {});

// Peak live activations per rank from the action order alone (the same figure simulate reports).
std::vector<int> peak_activations(const Schedule& schedule);

// Chrome trace ({"traceEvents": [...]}, loadable in Perfetto / chrome://tracing): one "X" event per
// action (name = action string, cat = compute | comm | fsdp, ts/dur in microseconds with one cost
// unit = `us_per_unit`), pid 0, tid = rank, plus one "M" thread_name event per rank.
std::string chrome_trace_json(const SimulationResult& result, double us_per_unit = 1000);
void write_chrome_trace(const SimulationResult& result, const std::string& path, double us_per_unit = 1000);

// A few lines: makespan, bubble fraction, per-rank compute / idle / peak activations.
std::string format_summary(const SimulationResult& result);

}  // namespace loom::pipeline
