// The model as the Trainer drives it, whatever parallelisms were applied to it: one object for
// the step (micro-batch boundaries, gradient synchronisation, zeroing, clipping), the optimizer
// and the checkpoint's state. A model's parallelize function (models/<model>/parallelize.h)
// applies TP, then FSDP or DDP, and hands the pieces over here; no code after it needs to know
// which were used.
//
// How the pieces compose:
//   gradients   DDP all-reduces over dp_replicate in backward; FSDP reduce-scatters over dp_shard
//               (and all-reduces HSDP replicas) in backward; TP's partial gradients (norm weights
//               under sequence parallelism) are summed over tp once the data-parallel reductions
//               are done (sums commute, so the order does not matter);
//   clipping    every element of every gradient counted once: squares of TP-sharded pieces summed
//               over the FSDP shard group and over tp, of TP-replicated pieces over the FSDP shard
//               group only;
//   checkpoint  each parameter (and its AdamW moments) is a box of its global tensor when TP
//               shards it, and FSDP's flat range within that box (or within the whole tensor);
//   pipeline    the rank holds only its stages' modules (each parameter under its global name, on
//               one pp rank), the step runs the schedule over the micro-batches, and the gradient
//               norm sums the pp ranks' squares.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/checkpoint/state_dict.h"
#include "loom/core/torch_compat.h"
#include "loom/ddp/ddp.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/fsdp/sharded_muon.h"
#include "loom/fsdp/sharded_optimizer.h"
#include "loom/parallel/optimizer_registry.h"
#include "loom/nn/attention.h"
#include "loom/nn/module.h"
#include "loom/optim/adamw.h"
#include "loom/optim/muon.h"
#include "loom/pipeline/executor.h"
#include "loom/tp/tensor_parallel.h"

namespace loom::parallel {

// One micro-batch as the model sees it on this rank: under context parallelism this rank's two
// chunks of every row (head-tail), with their positions and documents; otherwise the rows as
// loaded.
struct ModelBatch {
  torch::Tensor tokens;  // [B, T_local] int64
  torch::Tensor labels;  // [B, T_local] int64
  nn::TokenLayout layout;
};

using ForwardLoss = std::function<torch::Tensor(const ModelBatch& batch)>;
// Applied to micro-batch `index`'s loss before its backward (fault injection: a NaN loss); under
// pipeline parallelism to each of this rank's stage outputs instead (activations or the loss).
using LossHook = std::function<torch::Tensor(int64_t index, const torch::Tensor& loss)>;

struct ParallelParts {
  // The model parts this rank holds (TorchTitan's model_parts): the model, or this rank's pipeline
  // stages. Their parameters are this rank's pieces, under their global names.
  std::vector<std::shared_ptr<nn::Module>> modules;
  ForwardLoss forward_loss;            // mean loss of one micro-batch (no pipeline)
  // Pipeline parallelism: the executor of this rank's stages (modules) and the rows per
  // micro-batch; null: none.
  std::shared_ptr<pipeline::PipelineExecutor> pipeline;
  int64_t pipeline_microbatch_size = 0;
  // Data-parallel replicas of the pipeline (dp_replicate x pp): each holds the same stages and
  // sees other rows; their gradients are averaged once the schedule is done. Null: none.
  tensor::CommPtr pipeline_replicas;
  std::shared_ptr<tp::TensorParallel> tp;     // null: no tensor parallelism
  std::shared_ptr<fsdp::FSDPModule> fsdp;     // null: no FSDP (the root module's handle)
  std::unique_ptr<ddp::DataParallel> ddp;     // null: no DDP
  tensor::CommPtr cp;                         // null: no context parallelism (the "cp" group)
};

class ParallelizedModel {
 public:
  explicit ParallelizedModel(ParallelParts parts);

  const std::vector<std::shared_ptr<nn::Module>>& modules() const { return parts_.modules; }
  const pipeline::PipelineExecutor* pipeline() const { return parts_.pipeline.get(); }
  const tp::TensorParallel* tensor_parallel() const { return parts_.tp.get(); }
  fsdp::FSDPModule* fsdp() const { return parts_.fsdp.get(); }
  std::string describe() const;  // "TP 2 (sequence parallel, loss parallel) + FSDP over 2 ranks"

  // ---- The step ----
  // The loaded rows [B, T] (and, for block-causal attention, their document ids [B, T]) as this
  // rank's model takes them: under context parallelism its chunks i and 2c-1-i of each row, their
  // positions and documents. The loss is then the mean over this rank's tokens; FSDP's average
  // over dp_shard x cp makes the step's gradient the mean over all of them.
  ModelBatch prepare_batch(const torch::Tensor& tokens, const torch::Tensor& labels,
                           const torch::Tensor& document_ids = torch::Tensor()) const;
  // Forward and backward of one optimizer step over its loaded batches (gradient accumulation:
  // each contributes 1/k of the gradient); on return every gradient reduction is done. Without a
  // pipeline each batch is one micro-batch; with one, each batch is cut into micro-batches of
  // pipeline_microbatch_size rows and runs through the schedule. Returns this rank's loss for the
  // step (mean over the batches) as a float64 scalar (on the device, no host sync, without a
  // pipeline; with one, the last stage's loss, the same on every pp rank). `hook`: see LossHook;
  // with a pipeline it is applied to this rank's stage outputs (the loss on a last stage).
  torch::Tensor forward_backward(const std::vector<ModelBatch>& batches, const LossHook& hook = nullptr);
  void zero_grad();
  // The mean loss of one batch, forward only (validation; the caller holds a NoGradGuard): the
  // same forward as the step's, with every parallelism's collectives. Not with a pipeline, whose
  // schedules run forward and backward together.
  torch::Tensor forward_loss(const ModelBatch& batch);
  // Global 2-norm of the gradients over every mesh dim, each element counted once (a device
  // tensor, no host sync; collective over the mesh).
  torch::Tensor grad_norm();
  // grad_norm(), then scales the gradients by min(1, max_norm / norm); returns the norm before
  // clipping. (A step whose optimizer applies a StepGuard clips inside the update instead.)
  torch::Tensor clip_grad_norm_(double max_norm);
  // This rank's gradient pieces by parameter name, in module order (the same names on every rank).
  std::vector<std::pair<std::string, torch::Tensor>> local_gradients();
  // What this rank keeps between steps, for memory accounting (train/memory_accounting.h): its
  // parameters (FSDP: the shards) and their gradients, and whether the gradients stay allocated
  // between steps (FSDP's shards, DDP's buckets) or are set to None by zero_grad.
  std::vector<torch::Tensor> resident_parameters();
  std::vector<torch::Tensor> resident_gradients();
  bool gradients_persist() const { return parts_.fsdp != nullptr || parts_.ddp != nullptr; }

  // ---- Optimizer and state ----
  // The optimizer `spec` names over this rank's pieces: on FSDP's flat shards (spec.build_sharded,
  // whose groups the plan made with spec.fsdp_granularity) or over the trainable parameters
  // (spec.build); spec.check_layout refuses this layout and `device` first.
  std::unique_ptr<optim::Optimizer> build_optimizer(const OptimizerSpec& spec, const OptimizerRequest& request,
                                                    const c10::Device& device);
  // This rank's pieces of the parameters (component "model") and of `optimizer`'s state
  // ("optimizer"), with their global shapes: what a checkpoint saves and any layout loads.
  void add_to_state_dict(checkpoint::ShardedStateDict& state, optim::Optimizer& optimizer);
  // Writes this rank's pieces of the given whole parameters (e.g. a Hugging Face checkpoint).
  void load_full_parameters(const optim::TensorDict& full);

 private:
  // The checkpoint region of parameter `name` held as `local` (TP box; FSDP range inside it).
  // Before each micro-batch: `last` is the one whose backward synchronises gradients (DDP and
  // FSDP accumulate locally before it).
  void begin_micro_batch(bool last);
  // After the step's last backward: every gradient reduction done.
  void finish_gradient_sync();
  torch::Tensor pipeline_forward_backward(const std::vector<ModelBatch>& batches, const LossHook& hook);
  // Every part's parameters, in part order.
  std::vector<nn::NamedParameter> named_parameters();
  void add_piece(checkpoint::ShardedStateDict& state, const std::string& name, const std::string& component,
                 const std::string& param, const torch::Tensor& local, std::vector<int64_t> fsdp_shape,
                 std::optional<int64_t> fsdp_offset);

  ParallelParts parts_;
  // Pipeline with FSDP: the batch now in the schedule is the step's last (its last backward per
  // stage reduce-scatters).
  bool pipeline_batch_is_last_ = true;
  // Memory accounting where gradients are set to None between steps: the parameters'
  // AccumulateGrad nodes (kept alive for their hooks) and whether each has been counted this step.
  std::vector<compat::GradAccumulatorPtr> gradient_accumulators_;
  std::vector<char> gradient_counted_;
};

}  // namespace loom::parallel
