#include "loom/parallel/parameter_storage.h"

#include "loom/core/error.h"
#include "loom/fsdp/sharded_optimizer.h"

namespace loom::parallel {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The parameter an optimizer state entry belongs to ("<param>.exp_avg" -> "<param>"); empty for
// state that is not shaped like its parameter (the step counts).
std::string moment_parameter(const std::string& key) {
  for (const char* suffix : {".exp_avg_sq", ".exp_avg", ".momentum_buffer"}) {
    if (ends_with(key, suffix)) return key.substr(0, key.size() - std::string(suffix).size());
  }
  return "";
}

// Adds this rank's piece `local` of `param`'s tensor (a parameter or its optimizer state) under
// `name`: the box of its layout when another parallelism shards it (TP), and with FSDP
// (`fsdp_offset` set) the flat range of what FSDP sharded (that box, or the whole tensor of
// `fsdp_shape`).
void add_piece(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts, const std::string& name,
               const std::string& component, const std::string& param, const torch::Tensor& local,
               std::vector<int64_t> fsdp_shape, std::optional<int64_t> fsdp_offset) {
  const auto it = layouts.find(param);
  const tensor::TensorLayout* layout = it == layouts.end() ? nullptr : &it->second;
  tensor::Box box;
  if (layout != nullptr) box = layout->local_box();
  if (!fsdp_offset) {  // this rank holds its whole piece
    if (layout != nullptr) {
      state.add_box(name, component, layout->global_shape, box.offsets, local);
    } else {
      state.add_full(name, component, local);
    }
    return;
  }
  std::vector<checkpoint::LocalChunk> chunks;
  if (local.defined() && local.numel() > 0) {
    checkpoint::LocalChunk chunk{*fsdp_offset, local};
    if (layout != nullptr) chunk.box_offsets = box.offsets, chunk.box_sizes = box.sizes;
    chunks.push_back(std::move(chunk));
  }
  const auto dtype = local.defined() ? local.scalar_type() : c10::kFloat;
  state.add_chunks(name, component, layout != nullptr ? layout->global_shape : std::move(fsdp_shape), dtype,
                   std::move(chunks));
}

}  // namespace

// ---- ModuleParameters ----

std::vector<nn::NamedParameter> ModuleParameters::named_parameters() {
  std::vector<nn::NamedParameter> out;
  for (const auto& m : modules_) {
    for (auto& p : m->named_parameters()) out.push_back(std::move(p));
  }
  return out;
}

NamedGradients ModuleParameters::local_gradients() {
  NamedGradients out;
  for (const auto& p : named_parameters()) {
    if (p.slot->requires_grad) out.emplace_back(p.name, p.slot->tensor.grad());
  }
  return out;
}

std::vector<torch::Tensor> ModuleParameters::norm_gradients() {
  std::vector<torch::Tensor> out;
  for (auto& [name, g] : local_gradients()) out.push_back(std::move(g));
  return out;
}

std::vector<torch::Tensor> ModuleParameters::resident_parameters() {
  std::vector<torch::Tensor> out;
  for (const auto& p : named_parameters()) out.push_back(p.slot->tensor);
  return out;
}

void ModuleParameters::zero_grad() {
  for (const auto& m : modules_) m->zero_grad(/*set_to_none=*/true);
}

std::unique_ptr<optim::Optimizer> ModuleParameters::build_optimizer(const OptimizerSpec& spec,
                                                                    const OptimizerRequest& request) {
  optim::NamedTensors trainable;
  for (const auto& p : named_parameters()) {
    if (p.slot->requires_grad) trainable.emplace_back(p.name, p.slot->tensor);
  }
  return spec.build(trainable, request);
}

void ModuleParameters::add_parameters(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts,
                                      bool trainable) {
  for (const auto& p : named_parameters()) {
    if (p.slot->requires_grad != trainable) continue;
    add_piece(state, layouts, p.name, checkpoint::kModelComponent, p.name, p.slot->tensor.detach(), {}, std::nullopt);
  }
}

void ModuleParameters::add_gradients(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts) {
  for (const auto& p : named_parameters()) {
    if (!p.slot->requires_grad) continue;
    const torch::Tensor grad = p.slot->tensor.grad();
    add_piece(state, layouts, p.name, checkpoint::kModelComponent, p.name,
              grad.defined() ? grad.detach() : torch::zeros_like(p.slot->tensor.detach()), {}, std::nullopt);
  }
}

void ModuleParameters::add_optimizer_state(checkpoint::ShardedStateDict& state, optim::Optimizer& optimizer,
                                           const ParameterLayouts& layouts) {
  for (const auto& [name, t] : optimizer.state_dict()) {
    add_piece(state, layouts, "optimizer." + name, checkpoint::kOptimizerComponent, moment_parameter(name), t, {},
              std::nullopt);
  }
}

bool ModuleParameters::has_frozen_parameters() {
  for (const auto& p : named_parameters()) {
    if (!p.slot->requires_grad) return true;
  }
  return false;
}

void ModuleParameters::load_pieces(const optim::TensorDict& pieces, bool subset, const std::set<std::string>& optional) {
  auto params = named_parameters();
  size_t required = 0;
  for (const auto& p : params) required += optional.count(p.name) ? 0 : 1;
  // A pipeline rank holds some of the parameters; the others' values are for the other ranks.
  LOOM_REQUIRE(required == pieces.size() || (subset && required < pieces.size()), "initial weights have ",
               pieces.size(), " parameters but the model has ", required,
               "; check model.flavor and model.vocab_size");
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    auto it = pieces.find(p.name);
    if (it == pieces.end() && optional.count(p.name)) continue;
    LOOM_REQUIRE(it != pieces.end(), "initial weights have no parameter '", p.name,
                 "'; check model.flavor and model.vocab_size");
    LOOM_REQUIRE(it->second.sizes() == p.tensor().sizes(), "initial weight '", p.name, "' ", it->second.sizes(),
                 " does not match the model's ", p.tensor().sizes(), "; check model.flavor and model.vocab_size");
    p.slot->tensor.detach().copy_(it->second);
  }
}

// ---- FsdpParameters ----

NamedGradients FsdpParameters::local_gradients() {
  NamedGradients out;
  for (fsdp::FSDPParamGroup* group : fsdp_.param_groups()) {
    for (const auto& p : group->params()) out.emplace_back(fsdp_.param_fqn(*group, p), p.sharded_grad);
  }
  return out;
}

std::vector<torch::Tensor> FsdpParameters::norm_gradients() {
  std::vector<torch::Tensor> out;
  for (fsdp::FSDPParamGroup* group : fsdp_.param_groups()) out.push_back(group->sharded_grads());
  return out;
}

tensor::CommPtr FsdpParameters::norm_comm(const std::string& param) const {
  if (shard_comms_.empty()) {
    for (fsdp::FSDPParamGroup* group : fsdp_.param_groups()) {
      for (const auto& p : group->params()) shard_comms_[fsdp_.param_fqn(*group, p)] = group->mesh().shard;
    }
  }
  const auto it = shard_comms_.find(param);
  return it != shard_comms_.end() ? it->second : fsdp_.front().mesh().shard;
}

std::vector<torch::Tensor> FsdpParameters::resident_parameters() {
  // The unsharded parameters are views of FSDP's releasable buffers: buffers in flight.
  std::vector<torch::Tensor> out;
  for (fsdp::FSDPParamGroup* group : fsdp_.param_groups()) out.push_back(group->sharded_params());
  return out;
}

std::unique_ptr<optim::Optimizer> FsdpParameters::build_optimizer(const OptimizerSpec& spec,
                                                                  const OptimizerRequest& request) {
  return spec.build_sharded(fsdp_, request);
}

void FsdpParameters::describe_layout(OptimizerLayout& layout) const {
  const auto& mp = fsdp_.front().policy().mixed_precision;
  layout.half_precision_shards = mp.param_dtype == c10::kBFloat16 || mp.reduce_dtype == c10::kBFloat16;
}

void FsdpParameters::add_parameters(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts,
                                    bool trainable) {
  for (const auto& st : fsdp_.sharded_state_dict()) {
    if (st.trainable != trainable) continue;
    add_piece(state, layouts, st.name, checkpoint::kModelComponent, st.name, st.local, st.global_shape,
              st.global_offset);
  }
}

void FsdpParameters::add_gradients(checkpoint::ShardedStateDict& state, const ParameterLayouts& layouts) {
  // A parameter's sharded gradient mirrors its shard (the same flat range of the same tensor).
  std::map<std::string, torch::Tensor> grads;
  for (auto& [name, g] : local_gradients()) grads.emplace(name, std::move(g));
  for (const auto& st : fsdp_.sharded_state_dict()) {
    if (!st.trainable) continue;
    const auto it = grads.find(st.name);
    const bool has = it != grads.end() && it->second.defined() && it->second.numel() == st.local.numel();
    add_piece(state, layouts, st.name, checkpoint::kModelComponent, st.name,
              has ? it->second.detach().view_as(st.local) : torch::zeros_like(st.local.detach()), st.global_shape,
              st.global_offset);
  }
}

bool FsdpParameters::has_frozen_parameters() {
  for (fsdp::FSDPParamGroup* group : fsdp_.param_groups()) {
    for (const auto& p : group->params()) {
      if (!p.trainable) return true;
    }
  }
  return false;
}

void FsdpParameters::add_optimizer_state(checkpoint::ShardedStateDict& state, optim::Optimizer& optimizer,
                                         const ParameterLayouts& layouts) {
  const auto* sharded = dynamic_cast<const fsdp::ShardedOptimizer*>(&optimizer);
  LOOM_REQUIRE(sharded, "an FSDP model's optimizer must keep its state on the shards (fsdp::ShardedOptimizer); "
               "build it with build_optimizer");
  // AdamW8bit's codes are shaped like their parameter and its scales are [numel / block] with the
  // piece's block offset; Muon's momentum buffers are whole matrices on their owner and empty
  // elsewhere: all reshard as flat ranges like the parameters.
  for (const auto& st : sharded->sharded_state_dict()) {
    add_piece(state, layouts, "optimizer." + st.name, checkpoint::kOptimizerComponent, moment_parameter(st.name),
              st.local, st.global_shape, st.global_offset);
  }
  // Step counts are per group and identical on every rank: saved whole, under the same names as
  // the unsharded AdamW's, so a checkpoint moves between FSDP and non-FSDP layouts.
  for (const auto& [name, t] : optimizer.state_dict()) {
    if (ends_with(name, ".step")) state.add_full("optimizer." + name, checkpoint::kOptimizerComponent, t);
  }
}

void FsdpParameters::load_pieces(const optim::TensorDict& pieces, bool subset, const std::set<std::string>& optional) {
  // Each root takes the values of its own parameters; a pipeline rank's roots hold only some of
  // the model's (`subset`), a whole model's every one.
  size_t used = 0;
  for (const auto& root : fsdp_.roots()) {
    optim::TensorDict mine;
    for (fsdp::FSDPParamGroup* group : root->param_groups()) {
      for (const auto& p : group->params()) {
        const std::string name = root->param_fqn(*group, p);
        if (const auto it = pieces.find(name); it != pieces.end()) mine.emplace(name, it->second);
      }
    }
    used += mine.size();
    root->load_full_state_dict(mine, optional);
  }
  if (!subset && used != pieces.size()) {
    std::set<std::string> known;
    for (fsdp::FSDPParamGroup* group : fsdp_.param_groups()) {
      for (const auto& p : group->params()) known.insert(fsdp_.param_fqn(*group, p));
    }
    for (const auto& [name, t] : pieces) {
      LOOM_REQUIRE(known.count(name) > 0, "initial weights have parameter '", name,
                   "', which the model does not; check model.flavor and model.vocab_size");
    }
  }
}

}  // namespace loom::parallel
