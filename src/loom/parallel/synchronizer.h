// What each parallelism adds to the step besides its hooks on the modules, as ParallelizedModel
// drives it: a Synchronizer per applied parallelism, listed in the order the composition applied
// them (TP, CP, FSDP, DDP, the pipeline's replicas, PP). ParallelizedModel calls every one at each
// point of the step and never asks which are present, so a new dimension (EP next) is a
// placement (its parameters' tensor::TensorLayout), one Synchronizer and a slot in the
// composition.
//
//   point of the step        called                                       e.g.
//   prepare_batch            in list order, on each loaded batch          CP: this rank's chunks
//   begin_micro_batch(last)  in list order, before each micro-batch       DDP, FSDP: reduce on the last only
//   finish                   in reverse order, after the last backward:   DDP, FSDP, replicas reduce;
//                            outer (data-parallel) reductions first       then TP's partial sums
//   zero_grad                until one owns the gradients' storage        DDP's buckets
//   norm_comm(param)         the groups over which the squares of a        FSDP's shard group; TP for
//                            parameter's gradient are summed (its          its shards; PP for all
//                            pieces live on different ranks)
//   norm_comms()             every group norm_comm may name, the same      TP: tp; EP: ep; PP: pp
//                            list on every rank whatever parameters it
//                            holds (the norm's reductions are agreed on it)
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/nn/attention.h"
#include "loom/parallel/optimizer_registry.h"
#include "loom/tensor/collectives.h"

namespace loom::parallel {

// One micro-batch as the model sees it on this rank: under context parallelism this rank's two
// chunks of every row (head-tail), with their positions and documents; otherwise the rows as
// loaded.
struct ModelBatch {
  torch::Tensor tokens;  // [B, T_local] int64
  torch::Tensor labels;  // [B, T_local] int64
  nn::TokenLayout layout;
};

// This rank's gradient pieces by parameter name, in module order.
using NamedGradients = std::vector<std::pair<std::string, torch::Tensor>>;

class ParameterStorage;

class Synchronizer {
 public:
  virtual ~Synchronizer() = default;
  // A phrase for the run's log ("TP 2 (sequence parallel)", "FSDP over 2 ranks"), joined to the
  // previous one's by separator(); empty: nothing to say.
  virtual std::string describe() const = 0;
  virtual const char* separator() const { return " + "; }
  virtual void prepare_batch(ModelBatch& /*batch*/) const {}
  virtual void begin_micro_batch(bool /*last*/) {}
  virtual void finish(ParameterStorage& /*storage*/) {}
  // Zeroes the gradients when this parallelism keeps them (in place: they are views of its
  // buffers); false when it does not.
  virtual bool zero_grad() { return false; }
  virtual bool owns_gradients() const { return false; }
  virtual tensor::CommPtr norm_comm(const std::string& /*param*/) const { return nullptr; }
  // Every group norm_comm can return for any parameter of the model, not only this rank's: the
  // same list, in the same order, on every rank of the job. Pipeline ranks hold different
  // parameters, so what a rank's own parameters use cannot tell the norm which reductions its
  // peers will make; this does (ParallelizedModel::grad_norm).
  virtual std::vector<tensor::CommPtr> norm_comms() const { return {}; }
  // What the optimizer's layout check reads of this parallelism (its degree, its shards' dtype).
  virtual void describe_layout(OptimizerLayout& /*layout*/) const {}
  // Metrics of the last step for metrics.jsonl and TensorBoard (e.g. MoE expert loads), by key.
  virtual void add_metrics(std::map<std::string, double>& /*out*/) const {}
};

using Synchronizers = std::vector<std::shared_ptr<Synchronizer>>;

}  // namespace loom::parallel
