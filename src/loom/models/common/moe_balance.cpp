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
  std::vector<torch::Tensor> rows;
  for (moe::MoE* layer : layers_) {
    const int64_t n = layer->tokens_per_expert().numel();
    const torch::Tensor counts = all.narrow(0, offset, n);
    if (update_biases_) {
      layer->balance_experts(counts);
    } else {
      layer->reset_load_counts();
    }
    // Computed where the counts are; no value comes to the host here.
    const torch::Tensor mean = counts.mean();
    const torch::Tensor safe = torch::where(mean > 0, mean, torch::ones_like(mean));
    const torch::Tensor zero = torch::zeros_like(mean);
    const torch::Tensor bias = layer->expert_bias();
    rows.push_back(torch::stack({torch::where(mean > 0, counts.max() / safe, zero),
                                 torch::where(mean > 0, counts.min() / safe, zero),
                                 bias.defined() ? bias.norm().to(mean.device(), torch::kFloat) : zero}));
    offset += n;
  }
  last_ = torch::stack(rows);
}

void MoEBalanceSync::add_metrics(std::map<std::string, double>& out) const {
  if (!last_.defined()) return;
  const torch::Tensor host = last_.to(torch::kCPU, torch::kDouble).contiguous();
  const auto v = host.accessor<double, 2>();
  for (int64_t i = 0; i < host.size(0); ++i) {
    out["moe/" + names_[i] + "/load_max"] = v[i][0];
    out["moe/" + names_[i] + "/load_min"] = v[i][1];
    out["moe/" + names_[i] + "/bias_norm"] = v[i][2];
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
