#include "loom/models/common/moe_balance.h"

namespace loom::models {

MoEBalanceSync::MoEBalanceSync(std::vector<std::pair<std::string, moe::MoE*>> layers,
                               std::vector<tensor::CommPtr> comms, bool update_biases)
    : comms_(std::move(comms)), update_biases_(update_biases) {
  for (auto& [name, layer] : layers) {
    names_.push_back(name);
    layers_.push_back(layer);
  }
}

std::string MoEBalanceSync::describe() const {
  return c10::str("MoE load balancing (", layers_.size(), " layer", layers_.size() == 1 ? "" : "s",
                  update_biases_ ? ")" : "; selection biases frozen with the base)");
}

void MoEBalanceSync::finish(parallel::ParameterStorage&) {
  if (layers_.empty()) return;
  // All layers' counts in one buffer: one all-reduce per group per step.
  std::vector<torch::Tensor> counts;
  for (moe::MoE* layer : layers_) counts.push_back(layer->tokens_per_expert());
  torch::Tensor all = torch::cat(counts);
  for (const tensor::CommPtr& comm : comms_) comm->all_reduce(all, distributed::ReduceOp::kSum);
  int64_t offset = 0;
  last_.clear();
  for (moe::MoE* layer : layers_) {
    const int64_t n = layer->tokens_per_expert().numel();
    const torch::Tensor counts = all.narrow(0, offset, n);
    if (update_biases_) {
      layer->balance_experts(counts);
    } else {
      layer->reset_load_counts();
    }
    const double mean = counts.mean().item<double>();
    last_.push_back({mean > 0 ? counts.max().item<double>() / mean : 0.0,
                     mean > 0 ? counts.min().item<double>() / mean : 0.0,
                     layer->expert_bias().norm().item<double>()});
    offset += n;
  }
}

void MoEBalanceSync::add_metrics(std::map<std::string, double>& out) const {
  for (size_t i = 0; i < last_.size(); ++i) {
    out["moe/" + names_[i] + "/load_max"] = last_[i][0];
    out["moe/" + names_[i] + "/load_min"] = last_[i][1];
    out["moe/" + names_[i] + "/bias_norm"] = last_[i][2];
  }
}

std::vector<std::pair<std::string, moe::MoE*>> moe_layers(nn::Module& root) {
  std::vector<std::pair<std::string, moe::MoE*>> out;
  for (const auto& [name, module] : root.named_modules()) {
    if (auto* layer = dynamic_cast<moe::MoE*>(module)) out.emplace_back(name, layer);
  }
  return out;
}

std::vector<std::pair<std::string, moe::MoE*>> balanced_moe_layers(nn::Module& root) {
  std::vector<std::pair<std::string, moe::MoE*>> out;
  for (const auto& [name, layer] : moe_layers(root)) {
    if (layer->options().load_balance_coeff > 0) out.emplace_back(name, layer);
  }
  return out;
}

}  // namespace loom::models
