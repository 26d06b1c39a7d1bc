// The pipeline schedule IR: what every rank of a pipeline does in one training step, in order.
//
// An Action names one piece of work on one stage for one micro-batch, in the text form of PyTorch's
// torch.distributed.pipelining ("<stage><kind><microbatch>"):
//   0F3        forward of stage 0 on micro-batch 3
//   1B2        full backward (input and weight gradients) of stage 1 on micro-batch 2
//   2I0 / 2W0  zero-bubble split of the backward: gradient w.r.t. the stage input only (I), then
//              the weight gradients (W) later
//   0SEND_F3   send stage 0's output activations of micro-batch 3 to stage 1 (on another rank)
//   1RECV_F3   receive stage 1's input activations of micro-batch 3 from stage 0
//   1SEND_B2   send the gradient w.r.t. stage 1's input of micro-batch 2 to stage 0
//   0RECV_B2   receive stage 0's output gradient of micro-batch 2 from stage 1
//   1UNSHARD / 1RESHARD   FSDP: gather / free stage 1's parameters (no micro-batch)
//   1REDUCE_GRAD          FSDP: reduce-scatter stage 1's gradients, accumulated over the step's
//                         micro-batches, once after its last backward (no micro-batch)
//
// A Schedule is one vector of actions per pipeline rank plus the layout it assumes: pp ranks, v
// stages per rank, pp * v stages, which rank holds each stage (looped: stage s on rank s % pp;
// V-shape: rank r holds stages r and 2pp-1-r), and the number of micro-batches.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::pipeline {

enum class ActionKind : uint8_t {
  kForward,         // F
  kBackward,        // B: full backward
  kBackwardInput,   // I: gradient w.r.t. the stage input only
  kBackwardWeight,  // W: weight gradients of an earlier I
  kSendF,           // SEND_F
  kRecvF,           // RECV_F
  kSendB,           // SEND_B
  kRecvB,           // RECV_B
  kUnshard,         // UNSHARD (per stage, no micro-batch)
  kReshard,         // RESHARD (per stage, no micro-batch)
  kReduceGrad,      // REDUCE_GRAD (per stage, no micro-batch)
};

// "F", "B", "I", "W", "SEND_F", ...
const char* kind_name(ActionKind kind);
bool is_compute(ActionKind kind);  // F, B, I, W
bool is_send(ActionKind kind);
bool is_recv(ActionKind kind);
bool is_fsdp(ActionKind kind);  // UNSHARD, RESHARD, REDUCE_GRAD

struct Action {
  ActionKind kind = ActionKind::kForward;
  int stage = 0;
  int microbatch = -1;  // -1 for UNSHARD / RESHARD / REDUCE_GRAD

  // "0F3", "1SEND_B2", "1UNSHARD".
  std::string str() const;
  // The reverse of str(); a string that is no action is a UsageError naming it.
  static Action parse(std::string_view text);

  bool operator==(const Action&) const = default;
};

Action F(int stage, int microbatch);
Action B(int stage, int microbatch);
Action I(int stage, int microbatch);
Action W(int stage, int microbatch);

enum class StageLayout {
  kLoop,    // stage s on rank s % pp (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble)
  kV,       // rank r holds stages r and 2pp-1-r (ZBVZeroBubble, DualPipeV)
  kCustom,  // read from a CSV schedule: whichever rank's row holds the stage
};

// Which rank holds each of num_ranks * stages_per_rank stages.
std::vector<int> stage_to_rank_map(int num_ranks, int stages_per_rank, StageLayout layout);

struct Schedule {
  std::string name;  // "1F1B", ..., or "csv:<file>"
  int num_ranks = 1;
  int stages_per_rank = 1;
  int num_microbatches = 1;
  StageLayout layout = StageLayout::kLoop;
  std::vector<int> stage_to_rank;           // size num_stages()
  std::vector<std::vector<Action>> ranks;   // per rank, in execution order

  int num_stages() const { return static_cast<int>(stage_to_rank.size()); }
  int rank_of(int stage) const { return stage_to_rank.at(static_cast<size_t>(stage)); }
  // The stages rank r holds, ascending.
  std::vector<int> stages_of(int rank) const;
  // Whether any rank has SEND/RECV actions (a lowered schedule) / UNSHARD/RESHARD actions.
  bool has_communication() const;
  bool has_fsdp_actions() const;
  size_t num_actions() const;

  bool operator==(const Schedule&) const = default;
};

// One line per rank: "rank 0: 0F0 0F1 ...".
std::string format_actions(const Schedule& schedule);
// A table with one column per rank and one row per action index (PyTorch's _format_pipeline_order).
std::string format_table(const Schedule& schedule);

// PyTorch's `_dump_csv` / `_load_csv` format: one row per rank, comma-separated action strings
// (empty cells are skipped). Reading infers the layout: ranks = rows, stages = largest stage index
// + 1, each stage's rank = the row holding it, micro-batches = largest micro-batch index + 1.
std::string to_csv(const Schedule& schedule);
Schedule schedule_from_csv_text(std::string_view text, const std::string& name = "csv");
Schedule load_csv(const std::string& path);

// Checks the structure of a schedule (UsageError, one line, on the first problem):
//  - stage_to_rank is consistent and each rank holds stages_per_rank stages; every action is on a
//    stage its rank holds and a micro-batch in range;
//  - completeness: every (stage, micro-batch) has exactly one F and either one B or one I and
//    one W; on each rank the F comes before its B/I, and the I before its W;
//  - communication (when lowered): each SEND/RECV crosses ranks and is sent or received once,
//    after the compute that produces it / before the compute that consumes it;
//  - FSDP actions (when present): every compute of a stage lies between its UNSHARD and RESHARD,
//    and each stage has one REDUCE_GRAD, after its last backward (B or W) of the step.
// Whether the ranks can run it together without deadlock is the simulator's question.
void validate(const Schedule& schedule);

}  // namespace loom::pipeline
