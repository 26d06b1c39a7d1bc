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
#include "loom/optim/optimizer.h"

namespace loom::fsdp {

class ShardedAdamW : public optim::Optimizer {
 public:
  // Steps every group below `fsdp` (normally the root). Matrices decay by `weight_decay`;
  // parameters optim::is_weight_decayed exempts (by full shape) and frozen ones do not.
  ShardedAdamW(std::shared_ptr<FSDPModule> fsdp, optim::AdamWOptions options, double weight_decay);

  // Finalizes the backward (waits for the reductions), then one fused update per group whose
  // gradient shard holds a reduction since zero_grad (others are skipped, like a None .grad).
  void step() override;
  // FSDPModule::zero_grad (the gradient shards are always kept, so set_to_none is moot).
  void zero_grad(bool set_to_none = true) override;
  void set_lr(double lr) override { options_.lr = lr; }
  double lr() const override { return options_.lr; }

  optim::TensorDict state_dict() const override;
  void load_state_dict(const optim::TensorDict& state) override;
  // The moments with their global shapes and offsets (the step counts are replicated scalars and
  // are in state_dict()).
  std::vector<ShardedTensor> sharded_state_dict() const;

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

  std::shared_ptr<FSDPModule> fsdp_;
  optim::AdamWOptions options_;
  double weight_decay_;
  std::vector<Group> groups_;
};

}  // namespace loom::fsdp
