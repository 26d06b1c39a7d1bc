// AdamW on FSDP shards: each group's parameter shard is updated as one flat tensor with one fused
// kernel call (optim::adamw_step_flat), its moments are flat tensors of the shard's size, and
// parameters exempt from weight decay (1-D: norm scales, biases; and frozen ones) are element
// ranges of the shard. Padding has zero parameters and gradients and stays zero.
//
// The state dict names tensors per parameter ("<fqn>.exp_avg", "<fqn>.exp_avg_sq", "<fqn>.step"):
// each is this rank's piece of that parameter (a view into the flat state), so a checkpoint can
// save and reshard it like the parameters themselves (sharded_state_dict adds the offsets).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/fsdp/fully_shard.h"
#include "loom/optim/adamw.h"
#include "loom/optim/adamw8bit.h"
#include "loom/optim/optimizer.h"

namespace loom::fsdp {

// An optimizer whose state lives on FSDP's flat shards: its state_dict() pieces plus their global
// shapes and offsets, so a checkpoint saves and reshards them like the parameters.
class ShardedOptimizer : public optim::Optimizer {
 public:
  virtual std::vector<ShardedTensor> sharded_state_dict() const = 0;
};

class ShardedAdamW : public ShardedOptimizer {
 public:
  // Steps every group below the FSDP roots (the model's, or each pipeline stage's). Matrices decay by `weight_decay`;
  // parameters optim::is_weight_decayed exempts (by full shape) and frozen ones do not.
  ShardedAdamW(FSDPRoots fsdp, optim::AdamWOptions options, double weight_decay);

  // Finalizes the backward (waits for the reductions), then one fused update per group whose
  // gradient shard holds a reduction since zero_grad (others are skipped, like a None .grad).
  void step() override;
  bool applies_step_guard() const override { return true; }
  void step_with_guard(const optim::StepGuard& guard) override;
  // FSDPModule::zero_grad (the gradient shards are always kept, so set_to_none is moot).
  void zero_grad(bool set_to_none = true) override;
  void set_lr(double lr) override { options_.lr = lr; }
  double lr() const override { return options_.lr; }

  optim::TensorDict state_dict() const override;
  void load_state_dict(const optim::TensorDict& state) override;
  // The moments with their global shapes and offsets (the step counts are replicated scalars and
  // are in state_dict()).
  std::vector<ShardedTensor> sharded_state_dict() const override;

  const optim::AdamWOptions& options() const { return options_; }
  double weight_decay() const { return weight_decay_; }
  // Per group: the shard element ranges without weight decay (for tests and reports).
  std::vector<optim::ElementRanges> no_decay_ranges() const;

 private:
  struct Group {
    FSDPParamGroup* group;
    optim::FlatAdamWState state;
    optim::ElementRanges no_decay;
    std::vector<std::string> fqns;  // per parameter of the group
  };

  void step_groups(const optim::StepGuard* guard);

  FSDPRoots fsdp_;
  optim::AdamWOptions options_;
  double weight_decay_;
  std::vector<Group> groups_;
};

// The planner granularity AdamW8bit needs (FSDPPolicy::parameter_granularity): blocks of
// `block_size` elements for every parameter optim::is_block_quantized picks, elements otherwise.
ParameterGranularity adamw8bit_granularity(int64_t block_size);

// Block-wise 8-bit AdamW (optim/adamw8bit.h) on FSDP shards. The groups must have been planned with
// adamw8bit_granularity(block_size): then this rank's piece of a quantized parameter is whole
// blocks counted from the parameter's first element, each block is updated exactly as in one
// process, and the per-block scales of a piece are the run [offset / block_size, ...) of the
// parameter's scales, so checkpoints reshard codes and scales like any other tensor.
//
// State dict: per parameter "<fqn>.step" (the group's count, replicated), "<fqn>.exp_avg" (int8
// codes, or float32 for unquantized parameters) and "<fqn>.exp_avg_sq" (uint8 / float32), each this
// rank's piece shaped like the parameter's piece; quantized parameters also "<fqn>.exp_avg.absmax"
// and "<fqn>.exp_avg_sq.absmax" (float32, global shape [numel / block_size]).
class ShardedAdamW8bit : public ShardedOptimizer {
 public:
  ShardedAdamW8bit(FSDPRoots fsdp, optim::AdamWOptions options,
                   double weight_decay, int64_t block_size);

  // Finalizes the backward, then one fused pass over every block of every group with gradients.
  void step() override;
  void zero_grad(bool set_to_none = true) override;
  void set_lr(double lr) override { options_.lr = lr; }
  double lr() const override { return options_.lr; }

  optim::TensorDict state_dict() const override;
  void load_state_dict(const optim::TensorDict& state) override;
  // Codes, float32 moments and scales with their global shapes and offsets.
  std::vector<ShardedTensor> sharded_state_dict() const override;

  int64_t block_size() const { return block_size_; }
  // Bytes of this rank's moment tensors (codes, scales, float32 moments; not the step counts).
  int64_t state_nbytes() const;

 private:
  struct Piece {
    std::string fqn;
    size_t param = 0;             // in the group's params()
    tensor::FlatRange local;      // in the group's shard
    int64_t global_offset = 0;    // row-major index of the piece's first element in the parameter
    std::vector<int64_t> shape;   // the parameter's full shape
    optim::AdamW8bitState state;  // shaped like the piece
    double weight_decay = 0.0;
  };
  struct Group {
    FSDPParamGroup* group;
    torch::Tensor step;
    std::vector<Piece> pieces;
  };

  FSDPRoots fsdp_;
  optim::AdamWOptions options_;
  int64_t block_size_;
  std::vector<Group> groups_;
};

}  // namespace loom::fsdp
