#include "loom/models/llama3/parallelize.h"

#include "loom/core/error.h"
#include "loom/nn/init.h"

namespace loom::llama3 {

FSDPReshardSetting FSDPReshardSetting::parse(const std::string& text) {
  if (text == "default") return {fsdp::ReshardAfterForward::always(), false};
  if (text == "always") return {fsdp::ReshardAfterForward::always(), true};
  if (text == "never") return {fsdp::ReshardAfterForward::never(), true};
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  LOOM_REQUIRE_USAGE(digits, "parallelism.fsdp_reshard_after_forward '", text,
                     "' is not one of default, always, never or a positive integer");
  return {fsdp::ReshardAfterForward::parse(text), true};
}

std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Transformer& model, const fsdp::FSDPMesh& mesh,
                                             const fsdp::FSDPPolicy& policy,
                                             bool reshard_last_block) {
  const auto layers = model.layers().named_children();
  for (size_t i = 0; i < layers.size(); ++i) {
    fsdp::FSDPPolicy block_policy = policy;
    if (!reshard_last_block && i + 1 == layers.size()) {
      block_policy.reshard_after_forward = fsdp::ReshardAfterForward::never();
    }
    fsdp::fully_shard(*layers[i].second, mesh, block_policy, "layers." + layers[i].first);
  }
  return fsdp::fully_shard(model, mesh, policy, "root");
}

std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Transformer& model, const dist::DeviceMesh& mesh,
                                             const fsdp::FSDPPolicy& policy,
                                             bool reshard_last_block) {
  return apply_fsdp(model, fsdp::make_fsdp_mesh(mesh, policy), policy, reshard_last_block);
}

void init_sharded_weights(Transformer& model, fsdp::FSDPModule& fsdp, uint64_t seed,
                          c10::Device device) {
  for (const auto& b : model.named_buffers()) {
    if (b.slot->tensor.is_meta()) {
      b.slot->tensor = torch::empty(b.slot->tensor.sizes(), b.slot->tensor.options().device(device));
    }
  }
  model.reset_buffers();
  const ModelArgs& args = model.args();
  fsdp.init_parameters([&](const std::string& name, torch::Tensor& full) {
    nn::init_parameter(parameter_init(args, name), name, seed, full);
  });
}

}  // namespace loom::llama3
