#include "loom/fsdp/sharded_optimizer.h"

#include <algorithm>

#include "loom/core/error.h"

namespace loom::fsdp {
namespace {

// A piece of `flat` (a flat tensor shaped like the group's shard) at parameter p's place, shaped
// like p's sharded view.
torch::Tensor piece_of(const torch::Tensor& flat, const FSDPParamGroup& g,
                       const FSDPParamGroup::Param& p) {
  const tensor::FlatRange r = g.params_buffer().local_range(p.index);
  return flat.narrow(0, r.begin, r.size()).view(p.sharded.sizes());
}

}  // namespace

ShardedAdamW::ShardedAdamW(std::shared_ptr<FSDPModule> fsdp, optim::AdamWOptions options,
                           double weight_decay)
    : fsdp_(std::move(fsdp)), options_(options), weight_decay_(weight_decay) {
  LOOM_REQUIRE(fsdp_ != nullptr, "ShardedAdamW needs an FSDP module");
  LOOM_REQUIRE_USAGE(weight_decay_ >= 0.0, "weight decay must be >= 0, got ", weight_decay_);
  for (FSDPParamGroup* g : fsdp_->param_groups()) {
    Group group{g, optim::FlatAdamWState::zeros_like(g->sharded_params()), {}, {}};
    for (const auto& p : g->params()) {
      group.fqns.push_back(fsdp_->param_fqn(*g, p));
      const auto& shape = g->plan().tensors[p.index].shape;
      const tensor::FlatRange r = g->params_buffer().local_range(p.index);
      if (r.empty() || (p.trainable && optim::is_weight_decayed(group.fqns.back(), shape))) {
        continue;
      }
      // Frozen parameters: zero gradients and no decay leave them exactly unchanged.
      group.no_decay.emplace_back(r.begin, r.end);
    }
    std::sort(group.no_decay.begin(), group.no_decay.end());
    optim::ElementRanges merged;
    for (const auto& range : group.no_decay) {
      if (!merged.empty() && merged.back().second == range.first) {
        merged.back().second = range.second;
      } else {
        merged.push_back(range);
      }
    }
    group.no_decay = std::move(merged);
    groups_.push_back(std::move(group));
  }
  LOOM_REQUIRE(!groups_.empty(), "ShardedAdamW found no FSDP parameter groups");
}

void ShardedAdamW::step() {
  fsdp_->finalize_backward();
  for (Group& g : groups_) {
    if (!g.group->has_sharded_grads()) continue;
    optim::adamw_step_flat(g.group->sharded_params(), g.group->sharded_grads(), g.state, options_,
                           weight_decay_, g.no_decay);
  }
}

void ShardedAdamW::zero_grad(bool /*set_to_none*/) { fsdp_->zero_grad(); }

optim::TensorDict ShardedAdamW::state_dict() const {
  optim::TensorDict out;
  for (const Group& g : groups_) {
    for (size_t i = 0; i < g.fqns.size(); ++i) {
      const auto& p = g.group->params()[i];
      out[g.fqns[i] + ".step"] = g.state.step;
      out[g.fqns[i] + ".exp_avg"] = piece_of(g.state.exp_avg, *g.group, p);
      out[g.fqns[i] + ".exp_avg_sq"] = piece_of(g.state.exp_avg_sq, *g.group, p);
    }
  }
  return out;
}

void ShardedAdamW::load_state_dict(const optim::TensorDict& state) {
  const optim::TensorDict mine = state_dict();
  for (const auto& [name, target] : mine) {
    auto it = state.find(name);
    LOOM_REQUIRE(it != state.end(), "ShardedAdamW state dict is missing '", name, "'");
    LOOM_REQUIRE(it->second.sizes() == target.sizes(), "ShardedAdamW state '", name,
                 "' has shape ", it->second.sizes(), ", this rank's shard needs ", target.sizes(),
                 "; fix: reshard the checkpoint to this layout");
  }
  for (const auto& [name, t] : state) {
    LOOM_REQUIRE(mine.count(name) > 0, "ShardedAdamW state dict has unexpected entry '", name, "'");
  }
  torch::NoGradGuard no_grad;
  for (const auto& [name, target] : mine) target.copy_(state.at(name));
}

std::vector<ShardedTensor> ShardedAdamW::sharded_state_dict() const {
  std::vector<ShardedTensor> out;
  for (const Group& g : groups_) {
    for (size_t i = 0; i < g.fqns.size(); ++i) {
      const auto& p = g.group->params()[i];
      const auto& shape = g.group->plan().tensors[p.index].shape;
      const int64_t offset = g.group->params_buffer().global_range(p.index).begin;
      out.push_back(
          {g.fqns[i] + ".exp_avg", piece_of(g.state.exp_avg, *g.group, p), shape, offset});
      out.push_back(
          {g.fqns[i] + ".exp_avg_sq", piece_of(g.state.exp_avg_sq, *g.group, p), shape, offset});
    }
  }
  return out;
}

std::vector<optim::ElementRanges> ShardedAdamW::no_decay_ranges() const {
  std::vector<optim::ElementRanges> out;
  for (const Group& g : groups_) out.push_back(g.no_decay);
  return out;
}

}  // namespace loom::fsdp
