// Runs one rank's part of a lowered pipeline schedule (generators.h: build_schedule) on its stages,
// one action at a time, as PyTorch's _PipelineScheduleRuntime does:
//   F / B / I / W      the stage's forward / full backward / input gradient / weight gradients
//   SEND_F / SEND_B    isend of the stage's output / input gradient to the neighbouring stage's rank
//   RECV_F / RECV_B    irecv posted into a fresh buffer; the compute that consumes it waits for it
//   UNSHARD / RESHARD / REDUCE_GRAD   the callbacks of ExecutorOptions (FSDP's all-gather, free and
//                      gradient reduce-scatter of the stage; no-ops when unset)
// A run of consecutive SEND/RECV actions is posted as one batch (receives first, then sends, each
// direction in the schedule's order, so the k-th send from s to d still meets d's k-th receive from
// s as NCCL requires), and nothing waits for a send until the end of the step. Stages of the rank
// that are neighbours (the turn of a V, or pp = 1) hand activations and gradients over directly.
//
// Tags: tag(boundary b between stages b and b+1, micro-batch, direction) = (b * m + mb) * 2 + (0 for
// activations, 1 for gradients), so concurrent messages between the same two ranks never mix.
//
// The loss: the last stage returns each micro-batch's mean loss; the step's loss is their mean
// (what the unpipelined model reports for the global batch), broadcast from the rank that holds the
// last stage to every pp rank for logging.
#pragma once
#include <torch/torch.h>

#include <array>
#include <functional>
#include <memory>
#include <vector>

#include "loom/distributed/comm.h"
#include "loom/pipeline/schedule.h"
#include "loom/pipeline/stage.h"

namespace loom::pipeline {

struct ExecutorOptions {
  // The pipeline group: its group rank is the pipeline rank of the schedule.
  std::shared_ptr<distributed::Comm> comm;
  // The shape and dtype of every activation between stages: [micro-batch size, seq, dim] (a
  // receive must allocate before the data arrives).
  std::vector<int64_t> activation_shape;
  c10::ScalarType activation_dtype = c10::kFloat;
  c10::Device device = c10::kCPU;
  // UNSHARD / RESHARD / REDUCE_GRAD actions (FSDP inside the stages, driven by the schedule).
  // Null: nothing to do (unsharded stages).
  std::function<void(PipelineStage&)> unshard;
  std::function<void(PipelineStage&)> reshard;
  std::function<void(PipelineStage&)> reduce_grad;
};

// Seconds of one step on this rank: compute (F, B, I, W and the FSDP callbacks) and waiting (for
// received data, and at the end for sends to complete). Posting communication counts in neither.
struct StepTimes {
  double compute = 0;
  double wait = 0;
  double total = 0;
  // Compute seconds and action count of F, B, I and W (indexed by ActionKind): what the
  // simulator's Costs are, measured.
  std::array<double, 4> kind_seconds{};
  std::array<int, 4> kind_count{};
};

class PipelineExecutor {
 public:
  // `schedule`: lowered (with SEND/RECV actions where stages cross ranks); `stages`: this rank's
  // stages, i.e. schedule.stages_of(comm->rank()) in any order. Sets each stage's loss scale to
  // 1 / num_microbatches.
  PipelineExecutor(Schedule schedule, std::vector<std::shared_ptr<PipelineStage>> stages,
                   ExecutorOptions options);

  // One step: inputs[mb] = micro-batch mb's tokens (read by the rank holding stage 0), labels[mb]
  // (read by the rank holding the last stage); ranks that hold neither may pass empty vectors.
  // Gradients accumulate into the stages' parameters' .grad (zero them before). Returns the step's
  // loss (mean over micro-batches) on every pp rank.
  // `layouts[mb]`: micro-batch mb's token layout, read by every stage (empty: causal rows).
  // `reduce_grads` false: a batch of gradient accumulation before the step's last, whose
  // REDUCE_GRAD actions are skipped (the gradients keep accumulating unsharded).
  double step(const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& labels,
              const std::vector<nn::TokenLayout>& layouts = {}, bool reduce_grads = true);

  const Schedule& schedule() const { return schedule_; }
  int pp_rank() const { return rank_; }
  distributed::Comm& comm() const { return *options_.comm; }
  const std::vector<std::shared_ptr<PipelineStage>>& stages() const { return stages_; }
  const StepTimes& last_step_times() const { return times_; }
  // True when the schedule splits some backward into I and W (the zero-bubble schedules).
  bool splits_backward() const;

 private:
  PipelineStage& stage(int index);
  int tag(int boundary, int mb, bool gradient) const;

  Schedule schedule_;
  std::vector<std::shared_ptr<PipelineStage>> stages_;
  ExecutorOptions options_;
  int rank_ = 0;
  std::vector<std::vector<bool>> split_;  // [stage][mb]: the schedule runs I + W, not B
  StepTimes times_;
};

}  // namespace loom::pipeline
