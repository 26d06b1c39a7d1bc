// Where this rank's parameters, gradients and optimizer state live: in the modules' own slots
// (ModuleParameters: single process, DDP, TP, PP) or in FSDP's flat sharded buffers
// (FsdpParameters). ParallelizedModel reads gradients, builds the optimizer, saves and loads
// through it; a parameter's placement on the other mesh dims (a TP shard) is its slot's
// tensor::TensorLayout (nn::ParameterSlot::layout), read here for checkpoint boxes.
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "loom/checkpoint/state_dict.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/nn/module.h"
#include "loom/optim/optimizer.h"
#include "loom/parallel/optimizer_registry.h"
#include "loom/parallel/synchronizer.h"
#include "loom/tensor/placement.h"

namespace loom::parallel {

// The layouts of the parameters something other than the storage shards (TP), by global name.
using ParameterLayouts = std::map<std::string, tensor::TensorLayout>;

class ParameterStorage {
 public:
  virtual ~ParameterStorage() = default;
  // Completes the gradient reductions still in flight (FSDP's; a no-op once the step's are done).
  virtual void complete_reductions() {}
  // This rank's gradient pieces by parameter name, in module order (the same names on every rank).
  virtual NamedGradients local_gradients() = 0;
  // The tensors the gradient norm and clipping read: every element of local_gradients() once
  // (FSDP: its flat shards, whose padding is zero).
  virtual std::vector<torch::Tensor> norm_gradients() = 0;
  // The group over which the squares of parameter `param`'s gradient are summed (FSDP: the shard
  // group of its FSDP group: the experts' own under expert parallelism); null: none.
  virtual tensor::CommPtr norm_comm(const std::string& /*param*/) const { return nullptr; }
  // Every group norm_comm can return, the same list on every rank (see Synchronizer::norm_comms).
  virtual std::vector<tensor::CommPtr> norm_comms() const { return {}; }
  virtual std::vector<torch::Tensor> resident_parameters() = 0;
  virtual bool gradients_persist() const = 0;
  virtual void zero_grad() = 0;
  virtual std::unique_ptr<optim::Optimizer> build_optimizer(const OptimizerSpec& spec,
                                                            const OptimizerRequest& request) = 0;
  virtual void describe_layout(OptimizerLayout& /*layout*/) const {}
  // This rank's pieces of the trainable parameters (`trainable`) or of the frozen ones (LoRA's
  // base), component "model".
  virtual void add_parameters(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts,
                              bool trainable) = 0;
  // This rank's pieces of the trainable parameters' gradients as the last backward left them (after
  // every reduction, and after clipping once the step clipped), component "model", under the
  // parameters' names and with their global shapes and boxes: a gradient's pieces mirror its
  // parameter's (FSDP's sharded gradient has its shard's range), so a checkpoint of them loads
  // whole in one process (`loom check-layouts` compares layouts that way). A parameter without a
  // gradient this step adds zeros.
  virtual void add_gradients(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts) = 0;
  // This rank's pieces of `optimizer`'s state, component "optimizer".
  virtual void add_optimizer_state(checkpoint::ShardedStateDict& state, optim::Optimizer& optimizer,
                                   const ParameterLayouts& layouts) = 0;
  // Whether any parameter this rank holds is frozen (requires_grad false).
  virtual bool has_frozen_parameters() = 0;
  // Writes the given values (each parameter's piece of this rank's placement, e.g. its TP box)
  // into the storage; `subset`: the modules hold only some of them (pipeline stages); `optional`:
  // parameters the values may lack, which keep theirs (LoRA's adapters when loading the base).
  virtual void load_pieces(const optim::TensorDict& pieces, bool subset, const std::set<std::string>& optional) = 0;
};

// The modules' own parameters.
class ModuleParameters : public ParameterStorage {
 public:
  explicit ModuleParameters(std::vector<std::shared_ptr<nn::Module>> modules) : modules_(std::move(modules)) {}
  NamedGradients local_gradients() override;
  std::vector<torch::Tensor> norm_gradients() override;
  std::vector<torch::Tensor> resident_parameters() override;
  bool gradients_persist() const override { return false; }
  void zero_grad() override;
  std::unique_ptr<optim::Optimizer> build_optimizer(const OptimizerSpec& spec, const OptimizerRequest& request) override;
  void add_parameters(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts, bool trainable) override;
  void add_gradients(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts) override;
  void add_optimizer_state(checkpoint::ShardedStateDict& state, optim::Optimizer& optimizer,
                           const ParameterLayouts& layouts) override;
  bool has_frozen_parameters() override;
  void load_pieces(const optim::TensorDict& pieces, bool subset, const std::set<std::string>& optional) override;

 private:
  std::vector<nn::NamedParameter> named_parameters();
  std::vector<std::shared_ptr<nn::Module>> modules_;
};

// FSDP's flat shards: every group of the rank's FSDP roots (the model's, or each pipeline stage's).
class FsdpParameters : public ParameterStorage {
 public:
  // `shard_comms`: the shard group of every FSDP mesh the composition made (the dense one, the
  // experts' efsdp one), whether or not this rank's parts hold a group on each.
  FsdpParameters(fsdp::FSDPRoots fsdp, std::vector<tensor::CommPtr> shard_comms)
      : fsdp_(std::move(fsdp)), shard_comms_declared_(std::move(shard_comms)) {}
  void complete_reductions() override { fsdp_.finalize_backward(); }
  NamedGradients local_gradients() override;
  std::vector<torch::Tensor> norm_gradients() override;
  tensor::CommPtr norm_comm(const std::string& param) const override;
  std::vector<tensor::CommPtr> norm_comms() const override { return shard_comms_declared_; }
  std::vector<torch::Tensor> resident_parameters() override;
  bool gradients_persist() const override { return true; }
  void zero_grad() override { fsdp_.zero_grad(); }
  std::unique_ptr<optim::Optimizer> build_optimizer(const OptimizerSpec& spec, const OptimizerRequest& request) override;
  void describe_layout(OptimizerLayout& layout) const override;
  void add_parameters(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts, bool trainable) override;
  void add_gradients(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts) override;
  void add_optimizer_state(checkpoint::ShardedStateDict& state, optim::Optimizer& optimizer,
                           const ParameterLayouts& layouts) override;
  bool has_frozen_parameters() override;
  void load_pieces(const optim::TensorDict& pieces, bool subset, const std::set<std::string>& optional) override;
  const fsdp::FSDPRoots& fsdp() const { return fsdp_; }

 private:
  fsdp::FSDPRoots fsdp_;
  std::vector<tensor::CommPtr> shard_comms_declared_;
  mutable std::map<std::string, tensor::CommPtr> shard_comms_;  // by parameter, filled on first use
};

}  // namespace loom::parallel
