// Schedule generators (one per schedule, TorchTitan's / PyTorch's names) and the lowering passes
// that turn a compute-only schedule into what an executor runs (send/recv, FSDP unshard/reshard).
//
//   schedule            stages/rank   layout   backward   needs (m = micro-batches, pp = ranks)
//   GPipe               1             looped   B          m >= 1
//   1F1B                1             looped   B          m >= pp (PyTorch's rule)
//   Interleaved1F1B     v >= 1 (2)    looped   B          m % max(1, m / pp) == 0
//   LoopedBFS           v >= 1 (2)    looped   B          m >= 1
//   InterleavedZeroBubble v >= 1 (2)  looped   I + W      m % max(1, m / pp) == 0
//   ZBVZeroBubble       2             V        I + W      m >= 1
//   DualPipeV           2             V        B, I + W   m >= 2 pp (the number of stages)
// (v in parentheses: the default when --stages-per-rank is not given.) Every generator's output is
// checked by the simulator in the tests over a grid of (pp, m, v): no deadlock, complete.
#pragma once
#include "loom/core/strings.h"
#include <string>
#include <string_view>
#include <vector>

#include "loom/pipeline/schedule.h"

namespace loom::pipeline {

// The valid schedule names, in the order above.
const std::vector<std::string>& schedule_names();
// The canonical spelling of `name` (matched case-insensitively, as PyTorch does); an unknown name
// is a UsageError naming the nearest valid one (one it abbreviates, else by edit distance) and
// listing them all.
std::string canonical_schedule_name(std::string_view name);
// Whether the schedule runs several stages per rank (all but GPipe and 1F1B).
bool is_multi_stage(const std::string& canonical_name);
// Whether the schedule splits the backward into I and W actions.
bool splits_backward(const std::string& canonical_name);

struct ScheduleSpec {
  std::string name;           // any spelling canonical_schedule_name accepts
  int pp = 1;                 // pipeline ranks
  int microbatches = 1;       // micro-batches per step
  int stages_per_rank = 0;    // v; 0 = the schedule's default (1 single-stage, 2 multi-stage)
};

// The compute actions (F, B, I, W) of every rank in order, with the schedule's layout. Refuses
// (UsageError, one line) a combination the schedule cannot run, naming the rule.
Schedule generate_compute(const ScheduleSpec& spec);

// Inserts the communication of a compute-only schedule: after each F whose next stage is on
// another rank a SEND_F, and a RECV_F on that rank; after each B or I whose previous stage is on
// another rank a SEND_B, and a RECV_B on that rank. Like PyTorch's _PipelineScheduleRuntime
// lowering, the ranks advance one compute action per round in rank order and a receive is placed
// (posted early) the moment its send is, so sends and receives between two ranks are posted in the
// same order and every consumer finds its receive before it. A compute order that cannot run is a
// UsageError: "schedule deadlocks: rank 0 waits at 0B0 for 1B0 (rank 1), ...".
Schedule add_communication(const Schedule& compute_only);

// FSDP driven by the schedule (PyTorch pipelining's runtime does the same): on each rank, UNSHARD
// every stage once per step, before the compute action that precedes its first use (so the
// all-gather overlaps that compute); REDUCE_GRAD it right after its last backward (B, or W under a
// zero-bubble split, so the weight gradients are all in); RESHARD it after its last use. Works on
// compute-only and lowered schedules (SEND/RECV are not uses); a schedule that has FSDP actions
// already is refused.
Schedule add_fsdp_actions(const Schedule& schedule);

// generate_compute, then add_fsdp_actions when `fsdp`, then add_communication.
Schedule build_schedule(const ScheduleSpec& spec, bool fsdp = false);

using loom::edit_distance;  // (core/strings.h) for the nearest-name suggestion

}  // namespace loom::pipeline
