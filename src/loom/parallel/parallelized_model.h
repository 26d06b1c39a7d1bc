// The model as the Trainer drives it, whatever parallelisms were applied to it: one object for
// the step (micro-batch boundaries, gradient synchronisation, zeroing, clipping), the optimizer
// and the checkpoint's state. The composition (models/common/parallelize.h) applies TP, CP, AC,
// then FSDP or DDP, and hands over three things: where the parameters live (a ParameterStorage:
// the modules' slots or FSDP's shards), one Synchronizer per applied parallelism in composition
// order (synchronizer.h), and how the step runs (a StepRunner: the model's loss, or the pipeline
// schedule). ParallelizedModel calls them without asking which parallelisms they are.
//
// How the pieces compose:
//   gradients   DDP all-reduces over dp_replicate in backward; FSDP reduce-scatters over dp_shard
//               (and all-reduces HSDP replicas) in backward; TP's partial gradients (norm weights
//               under sequence parallelism, QK-norms) are summed over tp once the data-parallel
//               reductions are done (finish runs outer to inner);
//   clipping    every element of every gradient counted once: each gradient's squares are summed
//               (in float64) over the groups its pieces are spread over (FSDP's shard group, tp for
//               TP shards, ep for experts, pp for every stage's), one all-reduce per group; which
//               entries each all-reduce carries follows from the groups the layout declares
//               (norm_comms), never from the parameters a rank holds, so pipeline ranks agree;
//   checkpoint  each parameter (and its optimizer state) is a box of its global tensor when its
//               slot's layout shards it (TP), and FSDP's flat range within that box (or within the
//               whole tensor);
//   pipeline    the rank holds only its stages' modules (each parameter under its global name, on
//               one pp rank), and the step runs the schedule over the micro-batches.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/checkpoint/state_dict.h"
#include "loom/core/torch_compat.h"
#include "loom/nn/module.h"
#include "loom/optim/optimizer.h"
#include "loom/parallel/optimizer_registry.h"
#include "loom/parallel/parameter_storage.h"
#include "loom/parallel/step.h"
#include "loom/parallel/synchronizer.h"

namespace loom::parallel {

struct ParallelParts {
  // The model parts this rank holds (TorchTitan's model_parts): the model, or this rank's pipeline
  // stages. Their parameters are this rank's pieces, under their global names.
  std::vector<std::shared_ptr<nn::Module>> modules;
  // Where the parameters live; null: the modules' own slots (ModuleParameters).
  std::unique_ptr<ParameterStorage> storage;
  // One per applied parallelism, in the order the composition applied them.
  Synchronizers synchronizers;
  // How the step runs: the model's loss per micro-batch, or the pipeline schedule.
  std::unique_ptr<StepRunner> step;
};

class ParallelizedModel {
 public:
  explicit ParallelizedModel(ParallelParts parts);

  const std::vector<std::shared_ptr<nn::Module>>& modules() const { return parts_.modules; }
  std::string describe() const;  // "TP 2 (sequence parallel) + FSDP over 2 ranks"
  // The synchronizers' metrics of the last step (Synchronizer::add_metrics), by key.
  std::map<std::string, double> step_metrics() const;

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
  // The same step with an objective the caller computes (`loom rl`'s policy-gradient loss over
  // the model's log-probabilities): `loss` runs the forward through the modules' forward() (so
  // every parallelism's hooks run) and returns the scalar to differentiate; its backward is the
  // step's one micro-batch, and on return every gradient reduction is done (the data-parallel ones
  // average, as for the model's loss). Returns the loss, detached. Not with a pipeline, whose
  // schedule owns the forward.
  torch::Tensor forward_backward(const std::function<torch::Tensor()>& loss);
  void zero_grad();
  // The mean loss of one batch, forward only (validation; the caller holds a NoGradGuard): the
  // same forward as the step's, with every parallelism's collectives. Not with a pipeline, whose
  // schedules run forward and backward together.
  torch::Tensor forward_loss(const ModelBatch& batch);
  // Global 2-norm of the gradients over every mesh dim, each element counted once (a device
  // tensor, no host sync; collective over the mesh).
  torch::Tensor grad_norm();
  // grad_norm(), then scales the gradients by min(1, max_norm / norm) (not at all when max_norm is
  // 0); returns the norm before clipping. (A step whose optimizer applies a StepGuard clips inside the update instead.)
  torch::Tensor clip_grad_norm_(double max_norm);
  // This rank's gradient pieces by parameter name, in module order (the same names on every rank).
  std::vector<std::pair<std::string, torch::Tensor>> local_gradients();
  // What this rank keeps between steps, for memory accounting (train/memory_accounting.h): its
  // parameters (FSDP: the shards) and their gradients, and whether the gradients stay allocated
  // between steps (FSDP's shards, DDP's buckets) or are set to None by zero_grad.
  std::vector<torch::Tensor> resident_parameters();
  std::vector<torch::Tensor> resident_gradients();
  bool gradients_persist() const;

  // ---- Optimizer and state ----
  // The optimizer `spec` names over this rank's pieces: on FSDP's flat shards (spec.build_sharded,
  // whose groups the plan made with spec.fsdp_granularity) or over the trainable parameters
  // (spec.build); spec.check_layout refuses this layout and `device` first.
  std::unique_ptr<optim::Optimizer> build_optimizer(const OptimizerSpec& spec, const OptimizerRequest& request,
                                                    const c10::Device& device);
  // This rank's pieces of the parameters and persistent buffers (component "model") and of
  // `optimizer`'s state ("optimizer"), with their global shapes: what a training checkpoint saves
  // and any layout loads. `frozen`: whether the frozen parameters (LoRA's base) are in it; a
  // checkpoint leaves them out when they come from a file it references instead.
  void add_to_state_dict(checkpoint::ShardedStateDict& state, optim::Optimizer& optimizer, bool frozen = true);
  // This rank's pieces of the trainable parameters' gradients as the step left them (every
  // reduction done; clipped once the step clipped), component "model", under the parameters'
  // names and global shapes: a checkpoint of them gathers whole in one process.
  // Inline, so parallelized_model.cpp can be swapped for an older one (e.g. eef73f4's norm, to
  // reproduce issue 45 under `loom check-layouts`: docs/check_layouts.md).
  void add_gradients_to_state_dict(checkpoint::ShardedStateDict& state) {
    parts_.storage->complete_reductions();
    parts_.storage->add_gradients(state, parameter_layouts());
  }
  // The parameters initial weights fill (checkpoint.initial_load_path), component "model": the
  // frozen ones when some are frozen (the base under LoRA adapters), else every parameter; and
  // the persistent buffers.
  void add_base_to_state_dict(checkpoint::ShardedStateDict& state);
  bool has_frozen_parameters();
  // Writes this rank's pieces of the given whole parameters (e.g. a Hugging Face checkpoint): every
  // parameter of the base (add_base_to_state_dict); trainable parameters of a model with a frozen
  // base (adapters) may be absent and keep their initialization.
  void load_full_parameters(const optim::TensorDict& full);

 private:
  // Before each micro-batch: `last` is the one whose backward synchronises gradients (DDP and
  // FSDP accumulate locally before it).
  void begin_micro_batch(bool last);
  // After the step's last backward: every gradient reduction done.
  void finish_gradient_sync();
  // The layouts of the parameters a parallelism shards besides the storage (their slots'), by name.
  ParameterLayouts parameter_layouts();
  void add_persistent_buffers(checkpoint::ShardedStateDict& state);

  ParallelParts parts_;
  StepCallbacks callbacks_;
  // Memory accounting where gradients are set to None between steps: the parameters'
  // AccumulateGrad nodes (kept alive for their hooks) and whether each has been counted this step.
  std::vector<compat::GradAccumulatorPtr> gradient_accumulators_;
  std::vector<char> gradient_counted_;
};

}  // namespace loom::parallel
