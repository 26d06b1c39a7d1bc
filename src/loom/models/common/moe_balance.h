// Auxiliary-loss-free load balancing as a step of the composition: after the last backward of a
// step, every MoE layer's per-expert token counts are summed over the ranks that routed other
// tokens through the same layer (data and context parallel; tensor parallel, whose sequence-
// parallel ranks route their own tokens) and the layer's selection bias moves against the load
// (moe::MoE::balance_experts). Every rank then holds the same bias, as one process would.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/moe/moe.h"
#include "loom/nn/module.h"
#include "loom/parallel/synchronizer.h"

namespace loom::models {

class MoEBalanceSync : public parallel::Synchronizer {
 public:
  // `comms`: the groups to sum the counts over, each once (summing over ranks that routed the same
  // tokens only scales the counts, which the rule's sign ignores).
  MoEBalanceSync(std::vector<moe::MoE*> layers, std::vector<tensor::CommPtr> comms);
  std::string describe() const override;
  void finish(parallel::ParameterStorage& storage) override;

 private:
  std::vector<moe::MoE*> layers_;
  std::vector<tensor::CommPtr> comms_;
};

// Every MoE layer under `root` that balances its experts (load_balance_coeff > 0).
std::vector<moe::MoE*> balanced_moe_layers(nn::Module& root);

}  // namespace loom::models
