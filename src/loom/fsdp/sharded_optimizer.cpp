#include "loom/fsdp/sharded_optimizer.h"

#include <algorithm>
#include <map>

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

ShardedAdamW::ShardedAdamW(FSDPRoots fsdp, optim::AdamWOptions options,
                           double weight_decay)
    : fsdp_(std::move(fsdp)), options_(options), weight_decay_(weight_decay) {
  LOOM_REQUIRE(!fsdp_.empty(), "ShardedAdamW needs an FSDP module");
  LOOM_REQUIRE_USAGE(weight_decay_ >= 0.0, "weight decay must be >= 0, got ", weight_decay_);
  for (FSDPParamGroup* g : fsdp_.param_groups()) {
    if (!g->has_trainable()) continue;  // a frozen group (LoRA's base): no state, no update
    Group group{g, optim::FlatAdamWState::zeros_like(g->sharded_params()), {}, {}};
    for (const auto& p : g->params()) {
      group.fqns.push_back(fsdp_.param_fqn(*g, p));
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

void ShardedAdamW::step() { step_groups(nullptr); }

void ShardedAdamW::step_with_guard(const optim::StepGuard& guard) { step_groups(&guard); }

void ShardedAdamW::step_groups(const optim::StepGuard* guard) {
  fsdp_.finalize_backward();
  for (Group& g : groups_) {
    if (!g.group->has_sharded_grads()) continue;
    optim::adamw_step_flat(g.group->sharded_params(), g.group->sharded_grads(), g.state, options_,
                           weight_decay_, g.no_decay, guard);
  }
}

void ShardedAdamW::zero_grad(bool /*set_to_none*/) { fsdp_.zero_grad(); }

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
  optim::load_state_in_place(state_dict(), state, "ShardedAdamW");
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

ParameterGranularity adamw8bit_granularity(int64_t block_size) {
  LOOM_REQUIRE_USAGE(block_size >= 1, "AdamW8bit block_size must be >= 1, got ", block_size);
  return [block_size](std::string_view /*name*/, c10::IntArrayRef shape) {
    return optim::is_block_quantized(c10::multiply_integers(shape), block_size)
               ? tensor::Granularity::element_block(block_size)
               : tensor::Granularity::element();
  };
}

ShardedAdamW8bit::ShardedAdamW8bit(FSDPRoots fsdp, optim::AdamWOptions options,
                                   double weight_decay, int64_t block_size)
    : fsdp_(std::move(fsdp)), options_(options), block_size_(block_size) {
  LOOM_REQUIRE(!fsdp_.empty(), "ShardedAdamW8bit needs an FSDP module");
  LOOM_REQUIRE_USAGE(weight_decay >= 0.0, "weight decay must be >= 0, got ", weight_decay);
  LOOM_REQUIRE_USAGE(block_size_ >= 1, "AdamW8bit block_size must be >= 1, got ", block_size_);
  for (FSDPParamGroup* g : fsdp_.param_groups()) {
    if (!g->has_trainable()) continue;  // a frozen group (LoRA's base): no state, no update
    Group group{g, torch::zeros({}, g->sharded_params().options().dtype(torch::kFloat)), {}};
    const torch::Tensor& shard = g->sharded_params();
    LOOM_REQUIRE_USAGE(shard.scalar_type() == torch::kFloat, "AdamW8bit updates float32 master "
                       "weights, but FSDP group '", g->name(), "' holds ", shard.scalar_type());
    for (size_t i = 0; i < g->params().size(); ++i) {
      const auto& p = g->params()[i];
      const TensorLayout& layout = g->plan().tensors[p.index];
      Piece piece;
      piece.fqn = fsdp_.param_fqn(*g, p);
      piece.param = i;
      piece.local = g->params_buffer().local_range(p.index);
      piece.global_offset = g->params_buffer().global_range(p.index).begin;
      piece.shape = layout.shape;
      const bool quantized = optim::is_block_quantized(layout.numel, block_size_);
      if (quantized) {
        // The planner's guarantee this optimizer rests on: whole blocks from the parameter's start.
        LOOM_REQUIRE(layout.shard.granule_elems == block_size_ &&
                         piece.local.size() % block_size_ == 0 &&
                         piece.global_offset % block_size_ == 0,
                     "FSDP group '", g->name(), "' holds '", piece.fqn, "' in granules of ",
                     layout.shard.granule_elems, " elements, not AdamW8bit's blocks of ",
                     block_size_, "; fix: shard with FSDPPolicy::parameter_granularity = "
                     "adamw8bit_granularity(", block_size_, ")");
      }
      piece.state = optim::AdamW8bitState::zeros(p.sharded.sizes(), quantized, block_size_,
                                                 shard.options());
      piece.weight_decay =
          p.trainable && optim::is_weight_decayed(piece.fqn, layout.shape) ? weight_decay : 0.0;
      group.pieces.push_back(std::move(piece));
    }
    groups_.push_back(std::move(group));
  }
  LOOM_REQUIRE(!groups_.empty(), "ShardedAdamW8bit found no FSDP parameter groups");
}

void ShardedAdamW8bit::step() {
  fsdp_.finalize_backward();
  std::map<double, std::vector<optim::AdamW8bitPiece>> by_step;
  for (Group& g : groups_) {
    if (!g.group->has_sharded_grads()) continue;
    g.step.add_(1.0);
    auto& list = by_step[g.step.item<double>()];
    const torch::Tensor& params = g.group->sharded_params();
    const torch::Tensor& grads = g.group->sharded_grads();
    for (Piece& piece : g.pieces) {
      if (piece.local.empty()) continue;
      list.push_back({params.narrow(0, piece.local.begin, piece.local.size()),
                      grads.narrow(0, piece.local.begin, piece.local.size()), &piece.state,
                      piece.weight_decay});
    }
  }
  torch::NoGradGuard no_grad;
  for (const auto& [step, list] : by_step) optim::adamw8bit_step(list, options_, step, block_size_);
}

void ShardedAdamW8bit::zero_grad(bool /*set_to_none*/) { fsdp_.zero_grad(); }

optim::TensorDict ShardedAdamW8bit::state_dict() const {
  optim::TensorDict out;
  for (const Group& g : groups_) {
    for (const Piece& piece : g.pieces) {
      out[piece.fqn + ".step"] = g.step;
      optim::add_adamw8bit_state(out, piece.fqn, piece.state,
                                 g.group->params()[piece.param].sharded.sizes());
    }
  }
  return out;
}

void ShardedAdamW8bit::load_state_dict(const optim::TensorDict& state) {
  optim::load_state_in_place(state_dict(), state, "ShardedAdamW8bit");
}

std::vector<ShardedTensor> ShardedAdamW8bit::sharded_state_dict() const {
  std::vector<ShardedTensor> out;
  for (const Group& g : groups_) {
    for (const Piece& piece : g.pieces) {
      optim::TensorDict local;
      optim::add_adamw8bit_state(local, piece.fqn, piece.state,
                                 g.group->params()[piece.param].sharded.sizes());
      for (const char* moment : {".exp_avg", ".exp_avg_sq"}) {
        const std::string name = piece.fqn + moment;
        out.push_back({name, local.at(name), piece.shape, piece.global_offset});
        if (!piece.state.quantized) continue;
        const int64_t blocks = c10::multiply_integers(piece.shape) / block_size_;
        out.push_back({name + ".absmax", local.at(name + ".absmax"), {blocks},
                       piece.global_offset / block_size_});
      }
    }
  }
  return out;
}

int64_t ShardedAdamW8bit::state_nbytes() const {
  int64_t bytes = 0;
  for (const Group& g : groups_) {
    for (const Piece& piece : g.pieces) bytes += piece.state.nbytes();
  }
  return bytes;
}

}  // namespace loom::fsdp
