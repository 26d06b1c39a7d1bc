// How a step's batches run forward and backward on this rank: the model's loss on each batch as one
// micro-batch (LossStep), or the pipeline schedule over micro-batches of each batch
// (PipelineStep). ParallelizedModel hands either its callbacks, through which every Synchronizer
// sees the micro-batch boundaries.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "loom/parallel/synchronizer.h"
#include "loom/pipeline/executor.h"

namespace loom::parallel {

using ForwardLoss = std::function<torch::Tensor(const ModelBatch& batch)>;
// Applied to micro-batch `index`'s loss before its backward (fault injection: a NaN loss); under
// pipeline parallelism to each of this rank's stage outputs instead (activations or the loss).
using LossHook = std::function<torch::Tensor(int64_t index, const torch::Tensor& loss)>;

struct StepCallbacks {
  std::function<void(bool last)> begin_micro_batch;         // before each micro-batch (LossStep)
};

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // Forward and backward of the step's batches, each contributing 1/k of the gradient; returns
  // this rank's loss for the step (mean over the batches) as a float64 scalar.
  virtual torch::Tensor forward_backward(const std::vector<ModelBatch>& batches, const LossHook& hook,
                                         const StepCallbacks& callbacks) = 0;
  // The mean loss of one batch, forward only.
  virtual torch::Tensor forward_loss(const ModelBatch& batch) = 0;
  // Whether this rank's modules are parts of the model (pipeline stages) rather than all of it.
  virtual bool holds_model_parts() const { return false; }
};

// The model's forward_loss per batch; the loss summed on the device (no host sync per micro-batch).
class LossStep : public StepRunner {
 public:
  explicit LossStep(ForwardLoss forward_loss) : forward_loss_(std::move(forward_loss)) {}
  torch::Tensor forward_backward(const std::vector<ModelBatch>& batches, const LossHook& hook,
                                 const StepCallbacks& callbacks) override;
  torch::Tensor forward_loss(const ModelBatch& batch) override { return forward_loss_(batch); }

 private:
  ForwardLoss forward_loss_;
};

// Each batch cut into the schedule's micro-batches of `microbatch_size` rows and run through the
// executor; the loss is the last stage's, the same on every pp rank.
class PipelineStep : public StepRunner {
 public:
  PipelineStep(std::shared_ptr<pipeline::PipelineExecutor> executor, int64_t microbatch_size);
  torch::Tensor forward_backward(const std::vector<ModelBatch>& batches, const LossHook& hook,
                                 const StepCallbacks& callbacks) override;
  torch::Tensor forward_loss(const ModelBatch& batch) override;
  bool holds_model_parts() const override { return true; }

 private:
  std::shared_ptr<pipeline::PipelineExecutor> executor_;
  int64_t microbatch_size_;
};

}  // namespace loom::parallel
