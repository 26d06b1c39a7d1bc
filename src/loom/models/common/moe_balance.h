// Auxiliary-loss-free load balancing as a step of the composition: after the last backward of a
// step, every MoE layer's per-expert token counts are summed over the ranks that routed other
// tokens through the same layer (data and context parallel; tensor parallel, whose sequence-
// parallel ranks route their own tokens) and the layer's selection bias moves against the load
// (moe::MoE::balance_experts). Every rank then holds the same bias, as one process would.
#pragma once
#include <array>
#include <map>
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
  // `update_biases` false: the selection biases belong to a frozen base (LoRA adapters train on
  // it), so they stay as loaded, like every other base weight; the loads are still measured.
  MoEBalanceSync(std::vector<std::pair<std::string, moe::MoE*>> layers, std::vector<tensor::CommPtr> comms,
                 bool update_biases = true);
  std::string describe() const override;
  void finish(parallel::ParameterStorage& storage) override;
  // Per layer, of the last step: moe/<layer>/load_max and load_min (the busiest and idlest expert's
  // tokens over the mean: 1 when balanced) and bias_norm (the selection bias's L2 norm).
  void add_metrics(std::map<std::string, double>& out) const override;

 private:
  std::vector<std::string> names_;  // each layer's module path ("layers.3.moe")
  std::vector<moe::MoE*> layers_;
  // [layers, 3] float32 where the counts live: load_max, load_min, bias_norm per layer. Kept on the
  // device and read by add_metrics, at log steps only: a step does not wait for it.
  torch::Tensor last_;
  std::vector<tensor::CommPtr> comms_;
  bool update_biases_ = true;
};

// Every MoE layer under `root` that balances its experts (load_balance_coeff > 0), with its path.
std::vector<std::pair<std::string, moe::MoE*>> balanced_moe_layers(nn::Module& root);
// Every MoE layer under `root`, by path, in module order (what expert parallelism applies to).
std::vector<std::pair<std::string, moe::MoE*>> moe_layers(nn::Module& root);

}  // namespace loom::models
