#include "loom/parallel/step.h"

#include <ATen/record_function.h>

#include "loom/core/error.h"

namespace loom::parallel {

torch::Tensor LossStep::forward_backward(const std::vector<ModelBatch>& batches, const LossHook& hook,
                                         const StepCallbacks& callbacks) {
  const auto k = static_cast<int64_t>(batches.size());
  // The step's loss is summed on the device and read back by the caller once, with the gradient
  // norm: no host-device sync per micro-batch.
  torch::Tensor loss_sum;
  for (int64_t i = 0; i < k; ++i) {
    callbacks.begin_micro_batch(/*last=*/i + 1 == k);
    torch::Tensor loss;
    {
      // Profiler ranges (profiling/profiler.h): FSDP's all-gathers nest in the forward, its
      // reduce-scatters in the backward.
      RECORD_USER_SCOPE("loom::forward");
      loss = forward_loss_(batches[static_cast<size_t>(i)]);
      if (hook) loss = hook(i, loss);
    }
    const torch::Tensor part = loss.detach().to(torch::kFloat64) / static_cast<double>(k);
    loss_sum = loss_sum.defined() ? loss_sum + part : part;
    // Mean over micro-batches: each contributes 1/k of the step's gradient.
    RECORD_USER_SCOPE("loom::backward");
    (k > 1 ? loss / static_cast<double>(k) : loss).backward();
  }
  return loss_sum;
}

PipelineStep::PipelineStep(std::shared_ptr<pipeline::PipelineExecutor> executor, int64_t microbatch_size)
    : executor_(std::move(executor)), microbatch_size_(microbatch_size) {
  LOOM_REQUIRE(executor_ != nullptr && microbatch_size_ > 0, "a pipelined model needs its executor and micro-batch size");
}

torch::Tensor PipelineStep::forward_loss(const ModelBatch& /*batch*/) {
  fail_usage("a forward-only loss is not available with pipeline parallelism");
}

torch::Tensor PipelineStep::forward_backward(const std::vector<ModelBatch>& batches, const LossHook& hook,
                                             const StepCallbacks& /*callbacks*/) {
  pipeline::PipelineExecutor& executor = *executor_;
  const int m = executor.schedule().num_microbatches;
  const int64_t rows = microbatch_size_;
  const auto k = static_cast<int64_t>(batches.size());
  // Each micro-batch's mean loss enters the backward scaled by 1 / (m k): the step's gradient is
  // that of the mean loss over all m k micro-batches, as without a pipeline.
  for (const auto& stage : executor.stages()) {
    if (stage->is_last()) stage->set_loss_scale(1.0 / static_cast<double>(m * k));
  }
  double loss = 0;
  for (int64_t b = 0; b < k; ++b) {
    const ModelBatch& batch = batches[static_cast<size_t>(b)];
    LOOM_REQUIRE(batch.tokens.size(0) == rows * m, "pipeline step: a batch of ", batch.tokens.size(0),
                 " rows is not ", m, " micro-batches of ", rows);
    std::vector<torch::Tensor> inputs, labels;
    std::vector<nn::TokenLayout> layouts;
    for (int i = 0; i < m; ++i) {
      inputs.push_back(batch.tokens.narrow(0, i * rows, rows));
      labels.push_back(batch.labels.narrow(0, i * rows, rows));
      // Every stage masks attention by document and, under context parallelism, places its chunks
      // by their positions; every rank has the rows (they are loaded on all pp ranks), so the ids
      // and positions travel with no message.
      const auto& layout = batch.layout;
      if (layout.document_ids.defined() || layout.positions.defined()) {
        layouts.push_back({layout.positions, layout.document_ids.defined()
                                                 ? layout.document_ids.narrow(0, i * rows, rows)
                                                 : torch::Tensor()});
      }
    }
    // The hook sees micro-batch b * m + i, as without a pipeline it sees batch b (one per step):
    // it acts on this rank's stage outputs, so a NaN injected on any pipeline rank reaches the
    // loss that every pp rank reads.
    for (const auto& stage : executor.stages()) {
      if (!hook) break;
      stage->set_output_hook([&hook, b, m](int mb, const torch::Tensor& out) { return hook(b * m + mb, out); });
    }
    struct ClearHooks {
      pipeline::PipelineExecutor& executor;
      ~ClearHooks() {
        for (const auto& stage : executor.stages()) stage->set_output_hook(nullptr);
      }
    } clear_hooks{executor};
    // Gradients accumulate over the micro-batches and the accumulated batches; FSDP inside the
    // stages reduces them once, at the REDUCE_GRAD actions of the step's last batch.
    loss += executor.step(inputs, labels, layouts, /*reduce_grads=*/b == k - 1) / static_cast<double>(k);
  }
  return torch::tensor(loss, torch::kFloat64);
}

}  // namespace loom::parallel
