// Tensor parallelism (Megatron-LM's, in TorchTitan's vocabulary), applied to a model from outside.
// A TensorParallel object holds the tensor-parallel group and applies parallel styles to modules:
// it replaces parameters by this rank's shard and hooks forwards so activations move between
// placements with the autograd collectives of tensor/collectives.h. Model code stays as written
// for one device.
//
//   style                     parameter placement    forward of the module
//   colwise(linear)           weight Shard(0)        input Replicate -> output Shard(-1)
//   rowwise(linear)           weight Shard(1)        input Shard(-1) -> partial sums, then
//                                                    SP: reduce-scatter over the sequence (dim 1)
//                                                    no SP: all-reduce
//   rowwise_embedding         weight Shard(0)        ids Replicate -> rows this rank owns (others
//                                                    zero), reduced as rowwise
//   prepare_input(module)     -                      SP: all-gather the sequence before the
//                                                    module; no SP: gradient all-reduce in backward
//   sequence_parallel(norm)   weight Replicate       runs on this rank's tokens; SP: the weight's
//                                                    gradient is summed over the group after
//                                                    backward (sum_partial_gradients)
//   headwise(module, name)    that parameter         one value per query head (attention sinks),
//                             Shard(0)               split like the colwise wq's output heads
//   rowwise with a bias       bias Replicate         added once after the reduction (SP: its
//                                                    gradient summed over the group)
//   replicate_partial_grad    weights Replicate      runs on this rank's heads (a QK-norm inside a
//     (module)                                       colwise attention): every parameter's gradient
//                                                    is summed over the group, with or without SP
//                                                    (not those another parallelism split: EP's experts)
//
// Async TP (`async_tp`, needs SP): the all-gather before a module's colwise projections and the
// reduce-scatter after a rowwise one become collective matmuls (tp/collective_matmul.h) that
// overlap each chunk's transfer with the matmul of the previous one. prepare_input then computes
// the projections it is given together with the gather, and each projection's forward hands back
// its result; a rowwise linear's forward is replaced by matmul_reduce_scatter.
//
// With sequence parallelism (SP) the residual stream between blocks is sharded along the sequence,
// so norms and elementwise work are split and activations are 1/t the size. Every sharded
// parameter's layout (global shape, Shard(d) on mesh dim "tp") is recorded for initialization,
// checkpoints and clipping.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/nn/layers.h"
#include "loom/nn/module.h"
#include "loom/tensor/collectives.h"
#include "loom/tensor/placement.h"

namespace loom::tp {

inline constexpr const char* kMeshDim = "tp";
inline constexpr int64_t kSequenceDim = 1;  // activations are [batch, seq, hidden]

class TensorParallel {
 public:
  TensorParallel(tensor::CommPtr comm, bool sequence_parallel, bool async_tp = false);

  const tensor::CommPtr& comm() const { return comm_; }
  int degree() const { return comm_->size(); }
  int rank() const { return comm_->rank(); }
  bool sequence_parallel() const { return sequence_parallel_; }
  bool async_tp() const { return async_tp_; }

  // `fqn`: the module's dotted path in the model, which names its parameters in the layouts.
  void colwise(nn::Linear& linear, const std::string& fqn);
  void rowwise(nn::Linear& linear, const std::string& fqn);
  void rowwise_embedding(nn::Embedding& embedding, const std::string& fqn);
  // `consumers`: the colwise linears inside `module` that read its (gathered) input; under async TP
  // they are computed with the gather. Without async TP they are not needed.
  void prepare_input(nn::Module& module, const std::vector<nn::Linear*>& consumers = {});
  void sequence_parallel(nn::RMSNorm& norm, const std::string& fqn);
  void replicate_partial_grad(nn::Module& module, const std::string& fqn);
  // Parameter `name` of `module` (path `fqn`), [heads, ...] per query head: Shard(0), this rank's
  // heads (those its colwise wq computes).
  void headwise(nn::Module& module, const std::string& fqn, const std::string& name);
  // The output head: colwise on a prepared input; without loss parallel the vocab-sharded logits
  // are gathered (the plain loss then sees whole logits).
  void colwise_output(nn::Linear& output, const std::string& fqn, bool loss_parallel);

  // Layout of parameter `fqn` (local shape `local_shape` on this rank): Shard(d) on "tp" for the
  // parameters the styles split, Replicate for every other.
  tensor::TensorLayout layout_of(const std::string& fqn, const std::vector<int64_t>& local_shape) const;
  bool is_sharded(const std::string& fqn) const { return layouts_.count(fqn) > 0; }
  // Parameters each rank holds in full but whose gradients it only partly computes (SP norms,
  // replicate_partial_grad's modules):
  // their gradients are summed over the group once per step, before clipping.
  const std::vector<std::string>& partial_gradient_parameters() const { return partial_grads_; }
  // The sum, in place, as one all-reduce over the concatenated tensors (small: norm weights).
  void sum_partial_gradients(const std::vector<torch::Tensor>& grads) const;

  // Initializes this rank's piece `local` of parameter `fqn` with the value `init` draws for the
  // whole parameter (so every TP degree starts from the single-process weights).
  using InitFn = std::function<void(const std::string& fqn, torch::Tensor& full)>;
  void init_local(const std::string& fqn, torch::Tensor& local, const InitFn& init) const;

 private:
  void shard_parameter(nn::Module& module, const std::string& fqn, const std::string& name, int64_t dim);
  // `fqn`: the module's path, which the fault-injection switch LOOM_FAULT_SKIP_TP_REDUCE matches.
  void reduce_partial_output(nn::Module& module, const std::string& fqn);

  tensor::CommPtr comm_;
  bool sequence_parallel_;
  bool async_tp_;
  std::map<std::string, tensor::TensorLayout> layouts_;  // sharded parameters, by fqn
  std::vector<std::string> partial_grads_;
};

// Loss parallel: mean cross-entropy of `labels` [N] over logits hidden [N, D] x weight_local^T
// whose vocabulary is sharded over `comm` (this rank's rows start at `vocab_start`), without
// gathering the logits: per chunk of `chunk_tokens` tokens, the row max, the sum of exponentials
// and the target logit are reduced over the group. Gradients (computed during forward, chunk by
// chunk, so no [N, vocab] tensor exists) flow to `hidden` as this rank's partial sum (the
// collective that produced `hidden` sums them) and to `weight_local` in full. Labels equal to
// `ignore_index` do not count.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight_local,
                                           const torch::Tensor& labels, int64_t vocab_start,
                                           const tensor::CommPtr& comm, int64_t ignore_index = -100,
                                           int64_t chunk_tokens = 256);

}  // namespace loom::tp
