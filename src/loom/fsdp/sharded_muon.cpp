#include "loom/fsdp/sharded_muon.h"

#include "loom/core/error.h"

namespace loom::fsdp {
namespace {

// Elements [r.begin, r.end) of a group's flat shard, shaped `shape`.
torch::Tensor range_of(const torch::Tensor& flat, const tensor::FlatRange& r,
                       c10::IntArrayRef shape) {
  return flat.narrow(0, r.begin, r.size()).view(shape);
}

}  // namespace

ParameterGranularity muon_granularity() {
  return [](std::string_view name, c10::IntArrayRef shape) {
    return optim::is_muon_parameter(name, shape) ? tensor::Granularity::whole()
                                                 : tensor::Granularity::element();
  };
}

ShardedMuon::ShardedMuon(FSDPRoots fsdp, optim::AdamWOptions adamw_options,
                         optim::MuonOptions muon_options, double weight_decay)
    : fsdp_(std::move(fsdp)), adamw_options_(adamw_options), muon_options_(muon_options) {
  LOOM_REQUIRE(!fsdp_.empty(), "ShardedMuon needs an FSDP module");
  LOOM_REQUIRE_USAGE(weight_decay >= 0.0, "weight decay must be >= 0, got ", weight_decay);
  optim::check_muon_options(muon_options_);
  optim::ParamGroup decay{"decay", {}, {}, weight_decay}, no_decay{"no_decay", {}, {}, 0.0};
  std::vector<AdamWSlot> decay_slots, no_decay_slots;
  for (FSDPParamGroup* g : fsdp_.param_groups()) {
    for (size_t i = 0; i < g->params().size(); ++i) {
      const auto& p = g->params()[i];
      const TensorLayout& layout = g->plan().tensors[p.index];
      const std::string fqn = fsdp_.param_fqn(*g, p);
      const tensor::FlatRange local = g->params_buffer().local_range(p.index);
      const int64_t global_offset = g->params_buffer().global_range(p.index).begin;
      // A frozen parameter (LoRA's base) gets no state and no update.
      if (!p.trainable) continue;
      const bool decayed = optim::is_weight_decayed(fqn, layout.shape);
      if (optim::is_muon_parameter(fqn, layout.shape)) {
        // The planner's guarantee this optimizer rests on: the matrix is whole on one rank.
        LOOM_REQUIRE(local.empty() || local.size() == layout.numel, "FSDP group '", g->name(),
                     "' cuts Muon matrix '", fqn, "' ", c10::IntArrayRef(layout.shape),
                     " across ranks (this rank holds ", local.size(), " of its ", layout.numel,
                     " elements); fix: shard with FSDPPolicy::parameter_granularity = "
                     "fsdp::muon_granularity()");
        const auto options = g->sharded_params().options();
        MuonPiece piece{fqn, g, local, layout.shape, global_offset,
                        local.empty() ? torch::zeros({0}, options)
                                      : torch::zeros(layout.shape, options),
                        torch::zeros({}, options.dtype(torch::kFloat)),
                        decayed ? weight_decay : 0.0};
        muon_.push_back(std::move(piece));
        continue;
      }
      optim::ParamGroup& group = decayed ? decay : no_decay;
      group.param_names.push_back(fqn);
      group.params.push_back(p.sharded);
      (decayed ? decay_slots : no_decay_slots).push_back({g, i, layout.shape, global_offset});
    }
  }
  LOOM_REQUIRE(!muon_.empty() || !decay.params.empty() || !no_decay.params.empty(),
               "ShardedMuon found no FSDP parameters");
  std::vector<optim::ParamGroup> groups;
  auto add_group = [&](optim::ParamGroup& group, std::vector<AdamWSlot>& slots) {
    if (group.params.empty()) return;
    groups.push_back(std::move(group));
    adamw_slots_.push_back(std::move(slots));
  };
  add_group(decay, decay_slots);
  add_group(no_decay, no_decay_slots);
  adamw_ = std::make_unique<optim::AdamW>(std::move(groups), adamw_options_);
}

void ShardedMuon::set_lr(double lr) {
  adamw_options_.lr = lr;
  adamw_->set_lr(lr);
}

void ShardedMuon::step() {
  fsdp_.finalize_backward();
  // AdamW's pieces, including empty ones, so every rank counts the same steps (the step counts
  // are saved once, as replicated values).
  std::vector<std::vector<torch::Tensor>> grads(adamw_slots_.size());
  for (size_t k = 0; k < adamw_slots_.size(); ++k) {
    for (const AdamWSlot& s : adamw_slots_[k]) {
      if (!s.group->has_sharded_grads()) {
        grads[k].emplace_back();
        continue;
      }
      const auto& p = s.group->params()[s.param];
      grads[k].push_back(range_of(s.group->sharded_grads(),
                                  s.group->params_buffer().local_range(p.index),
                                  p.sharded.sizes()));
    }
  }
  adamw_->step(grads);
  torch::NoGradGuard no_grad;
  for (MuonPiece& m : muon_) {
    if (!m.group->has_sharded_grads()) continue;
    m.step.add_(1.0);
    if (m.local.empty()) continue;  // another rank owns this matrix
    muon_update(range_of(m.group->sharded_params(), m.local, m.shape),
                range_of(m.group->sharded_grads(), m.local, m.shape), m.momentum_buffer,
                adamw_options_.lr, m.weight_decay, muon_options_);
  }
}

void ShardedMuon::zero_grad(bool /*set_to_none*/) { fsdp_.zero_grad(); }

optim::TensorDict ShardedMuon::state_dict() const {
  optim::TensorDict out = adamw_->state_dict();
  for (const MuonPiece& m : muon_) {
    out[optim::muon_momentum_key(m.fqn)] = m.momentum_buffer;
    out[m.fqn + ".step"] = m.step;
  }
  return out;
}

void ShardedMuon::load_state_dict(const optim::TensorDict& state) {
  optim::load_state_in_place(state_dict(), state, "ShardedMuon");
}

std::vector<ShardedTensor> ShardedMuon::sharded_state_dict() const {
  std::vector<ShardedTensor> out;
  const auto& groups = adamw_->param_groups();
  for (size_t k = 0; k < adamw_slots_.size(); ++k) {
    for (size_t i = 0; i < adamw_slots_[k].size(); ++i) {
      const AdamWSlot& s = adamw_slots_[k][i];
      const std::string& fqn = groups[k].param_names[i];
      const optim::AdamWParamState& st = adamw_->state(fqn);
      out.push_back({fqn + ".exp_avg", st.exp_avg, s.shape, s.global_offset});
      out.push_back({fqn + ".exp_avg_sq", st.exp_avg_sq, s.shape, s.global_offset});
    }
  }
  for (const MuonPiece& m : muon_) {
    out.push_back({optim::muon_momentum_key(m.fqn), m.momentum_buffer, m.shape,
                   m.local.empty() ? 0 : m.global_offset});
  }
  return out;
}

std::vector<std::string> ShardedMuon::owned_muon_parameters() const {
  std::vector<std::string> out;
  for (const MuonPiece& m : muon_) {
    if (!m.local.empty()) out.push_back(m.fqn);
  }
  return out;
}

int64_t ShardedMuon::owned_muon_numel() const {
  int64_t n = 0;
  for (const MuonPiece& m : muon_) n += m.local.size();
  return n;
}

}  // namespace loom::fsdp
