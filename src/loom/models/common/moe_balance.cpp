#include "loom/models/common/moe_balance.h"

namespace loom::models {

MoEBalanceSync::MoEBalanceSync(std::vector<moe::MoE*> layers, std::vector<tensor::CommPtr> comms)
    : layers_(std::move(layers)), comms_(std::move(comms)) {}

std::string MoEBalanceSync::describe() const {
  return c10::str("MoE load balancing (", layers_.size(), " layer", layers_.size() == 1 ? "" : "s", ")");
}

void MoEBalanceSync::finish(parallel::ParameterStorage&) {
  if (layers_.empty()) return;
  // All layers' counts in one buffer: one all-reduce per group per step.
  std::vector<torch::Tensor> counts;
  for (moe::MoE* layer : layers_) counts.push_back(layer->tokens_per_expert());
  torch::Tensor all = torch::cat(counts);
  for (const tensor::CommPtr& comm : comms_) comm->all_reduce(all, distributed::ReduceOp::kSum);
  int64_t offset = 0;
  for (moe::MoE* layer : layers_) {
    const int64_t n = layer->tokens_per_expert().numel();
    layer->balance_experts(all.narrow(0, offset, n));
    offset += n;
  }
}

std::vector<moe::MoE*> balanced_moe_layers(nn::Module& root) {
  std::vector<moe::MoE*> out;
  for (const auto& [name, module] : root.named_modules()) {
    auto* layer = dynamic_cast<moe::MoE*>(module);
    if (layer != nullptr && layer->options().load_balance_coeff > 0) out.push_back(layer);
  }
  return out;
}

}  // namespace loom::models
