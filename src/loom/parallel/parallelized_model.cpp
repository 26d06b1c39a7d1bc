#include "loom/parallel/parallelized_model.h"

#include <map>
#include <set>

#include <ATen/record_function.h>

#include <algorithm>

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/optim/clip_grad.h"

namespace loom::parallel {

ParallelizedModel::ParallelizedModel(ParallelParts parts) : parts_(std::move(parts)) {
  LOOM_REQUIRE(!parts_.modules.empty(), "ParallelizedModel needs the model's parts");
  for (const auto& m : parts_.modules) LOOM_REQUIRE(m != nullptr, "ParallelizedModel: a null model part");
  LOOM_REQUIRE(parts_.step != nullptr, "ParallelizedModel needs the step's runner (the model's loss or a pipeline)");
  if (!parts_.storage) parts_.storage = std::make_unique<ModuleParameters>(parts_.modules);
  int owners = 0;
  for (const auto& s : parts_.synchronizers) owners += s->owns_gradients() ? 1 : 0;
  LOOM_REQUIRE(owners <= 1 && !(owners == 1 && parts_.storage->gradients_persist()),
               "two owners of the same gradients (FSDP and DDP on the same parameters: HSDP replicates "
               "through FSDP, dp_replicate, not DDP)");
  callbacks_.begin_micro_batch = [this](bool last) { begin_micro_batch(last); };
  if (!gradients_persist()) {
    // Memory accounting (core/memory.h): gradients set to None between steps are created again by
    // each step's backward; the first one of each parameter in a step is counted as a gradient
    // rather than an activation. A hook after the parameter's AccumulateGrad node, which runs once
    // per backward that reaches it (a tensor hook would also run for autograd::grad captures,
    // which activation checkpointing makes).
    for (const auto& m : parts_.modules) {
      for (const auto& p : m->named_parameters()) {
        if (!p.slot->requires_grad || !p.slot->tensor.requires_grad()) continue;
        const size_t i = gradient_accumulators_.size();
        nn::ParameterSlot* slot = p.slot;
        auto accumulator = torch::autograd::impl::grad_accumulator(slot->tensor);
        accumulator->add_post_hook(std::make_unique<compat::AfterAccumulateGrad>([this, i, slot] {
          if (gradient_counted_[i] || !slot->tensor.grad().defined()) return;
          gradient_counted_[i] = 1;
          memory::note_gradient_bytes(slot->tensor.device(), static_cast<int64_t>(slot->tensor.grad().nbytes()));
        }));
        gradient_accumulators_.push_back(std::move(accumulator));
      }
    }
    gradient_counted_.assign(gradient_accumulators_.size(), 0);
  }
}

bool ParallelizedModel::gradients_persist() const {
  if (parts_.storage->gradients_persist()) return true;
  return std::any_of(parts_.synchronizers.begin(), parts_.synchronizers.end(),
                     [](const auto& s) { return s->owns_gradients(); });
}

std::string ParallelizedModel::describe() const {
  std::string out;
  for (const auto& s : parts_.synchronizers) {
    const std::string part = s->describe();
    if (!part.empty()) out += (out.empty() ? "" : s->separator()) + part;
  }
  return out.empty() ? "one rank" : out;
}

void ParallelizedModel::begin_micro_batch(bool last) {
  for (const auto& s : parts_.synchronizers) s->begin_micro_batch(last);
}

ModelBatch ParallelizedModel::prepare_batch(const torch::Tensor& tokens, const torch::Tensor& labels,
                                            const torch::Tensor& document_ids) const {
  ModelBatch batch{tokens, labels, {torch::Tensor(), document_ids}};
  for (const auto& s : parts_.synchronizers) s->prepare_batch(batch);
  return batch;
}

torch::Tensor ParallelizedModel::forward_backward(const std::vector<ModelBatch>& batches, const LossHook& hook) {
  LOOM_REQUIRE(!batches.empty(), "forward_backward needs at least one batch");
  torch::Tensor loss = parts_.step->forward_backward(batches, hook, callbacks_);
  finish_gradient_sync();
  return loss;
}

torch::Tensor ParallelizedModel::forward_backward(const std::function<torch::Tensor()>& loss) {
  LOOM_REQUIRE_USAGE(!parts_.step->holds_model_parts(),
                     "a step with the caller's loss needs the whole model on each rank, not pipeline stages");
  begin_micro_batch(/*last=*/true);
  torch::Tensor value;
  {
    RECORD_USER_SCOPE("loom::forward");
    value = loss();
  }
  {
    RECORD_USER_SCOPE("loom::backward");
    value.backward();
  }
  finish_gradient_sync();
  return value.detach();
}

torch::Tensor ParallelizedModel::forward_loss(const ModelBatch& batch) { return parts_.step->forward_loss(batch); }

void ParallelizedModel::finish_gradient_sync() {
  RECORD_USER_SCOPE("loom::gradient_sync");
  // Outer (applied last: the data-parallel reductions) first, then inner (TP's partial sums).
  for (auto it = parts_.synchronizers.rbegin(); it != parts_.synchronizers.rend(); ++it) (*it)->finish(*parts_.storage);
}

void ParallelizedModel::zero_grad() {
  bool zeroed = false;
  for (const auto& s : parts_.synchronizers) zeroed = s->zero_grad() || zeroed;
  if (zeroed) return;
  parts_.storage->zero_grad();
  std::fill(gradient_counted_.begin(), gradient_counted_.end(), 0);
}

NamedGradients ParallelizedModel::local_gradients() { return parts_.storage->local_gradients(); }

std::vector<torch::Tensor> ParallelizedModel::resident_parameters() { return parts_.storage->resident_parameters(); }

std::vector<torch::Tensor> ParallelizedModel::resident_gradients() {
  std::vector<torch::Tensor> out;
  for (const auto& [name, g] : local_gradients()) out.push_back(g);
  return out;
}

torch::Tensor ParallelizedModel::grad_norm() {
  ParameterStorage& storage = *parts_.storage;
  storage.complete_reductions();
  // The norm is the square root of one sum: every element of every gradient counted once. A
  // gradient whose pieces are spread over some groups of ranks (FSDP's shard group, tp for a TP
  // shard, ep for an expert, pp for every stage's) has its squares summed over exactly those
  // groups, and over no other (a piece another rank holds identically, a replica, is counted
  // once). The rule that makes the reductions match on every rank: the groups are the layout's
  // (`declared`, the same list on every rank: the storage's, then each parallelism's, outer to
  // inner), not the ones this rank's parameters happen to use. Each gradient's set of groups is a
  // bit mask over that list; the squares are summed per mask, and the reduction over group i
  // carries one entry per mask that names i and no group before it, as groups before it are done
  // (entries whose remaining groups agree are added first). Every rank of group i so sends the
  // same entries in the same order, whichever parameters it holds: pipeline stages hold different
  // ones (a stage may have no TP-replicated norm first, or no MoE layer at all), so an order taken
  // from a rank's own parameters would add one stage's norms to another's shards.
  std::vector<tensor::CommPtr> declared;
  auto declare = [&declared](const std::vector<tensor::CommPtr>& comms) {
    for (const auto& c : comms) {
      if (c && std::find(declared.begin(), declared.end(), c) == declared.end()) declared.push_back(c);
    }
  };
  declare(storage.norm_comms());
  for (auto it = parts_.synchronizers.rbegin(); it != parts_.synchronizers.rend(); ++it) declare((*it)->norm_comms());
  LOOM_REQUIRE(declared.size() < 16, "the gradient norm supports at most 15 groups of ranks, got ", declared.size());
  auto mask_of = [&](const std::string& name) {
    uint32_t mask = 0;
    auto add = [&](const tensor::CommPtr& c) {
      if (!c) return;
      const auto it = std::find(declared.begin(), declared.end(), c);
      LOOM_REQUIRE(it != declared.end(), "the gradient of ", name, " is spread over the group ", c->describe(),
                   ", which no parallelism declares in norm_comms()");
      mask |= 1u << static_cast<uint32_t>(it - declared.begin());
    };
    add(storage.norm_comm(name));
    for (const auto& s : parts_.synchronizers) add(s->norm_comm(name));
    return mask;
  };
  // This rank's gradients by mask.
  std::map<uint32_t, std::vector<torch::Tensor>> by_mask;
  torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat64);
  for (const auto& [name, g] : storage.local_gradients()) {
    auto& list = by_mask[mask_of(name)];
    if (!g.defined() || g.numel() == 0) continue;
    options = options.device(g.device());
    list.push_back(g);
  }
  const uint32_t masks = 1u << static_cast<uint32_t>(declared.size());
  std::vector<torch::Tensor> squares(masks);
  if (by_mask.size() == 1) {
    // Every local gradient spread over the same groups: the storage's tensors (FSDP: its flat
    // shards, fewer and larger, whose padding is zero).
    squares[by_mask.begin()->first] = optim::sum_of_squares(storage.norm_gradients(), options);
  } else {
    for (const auto& [mask, list] : by_mask) squares[mask] = optim::sum_of_squares(list, options);
  }
  const torch::Tensor zero = torch::zeros({}, options);
  for (auto& s : squares) {
    if (!s.defined()) s = zero;
  }
  for (uint32_t i = 0; i < declared.size(); ++i) {
    // Entries that differ only in the groups already reduced (bits below i) now need the same
    // remaining reductions: add them into the entry with those bits clear, in mask order.
    const uint32_t done = (1u << i) - 1;
    for (uint32_t m = 0; m < masks; ++m) {
      if ((m & done) != 0) squares[m & ~done] = squares[m & ~done] + squares[m], squares[m] = zero;
    }
    std::vector<uint32_t> members;
    for (uint32_t m = 0; m < masks; ++m) {
      if ((m & done) == 0 && (m >> i & 1u) != 0) members.push_back(m);
    }
    std::vector<torch::Tensor> parts;
    for (uint32_t m : members) parts.push_back(squares[m].reshape({1}));
    torch::Tensor stacked = at::cat(parts);
    declared[i]->all_reduce(stacked, distributed::ReduceOp::kSum);
    for (size_t j = 0; j < members.size(); ++j) squares[members[j]] = stacked.narrow(0, static_cast<int64_t>(j), 1).reshape({});
  }
  torch::Tensor total = squares[0];
  for (uint32_t m = 1; m < masks; ++m) total = total + squares[m];
  // Float32 like PyTorch's norm of float32 gradients (float64 when the squares are, see
  // optim::total_grad_norm); the squares were summed in float64.
  bool float64 = false;
  for (const auto& [mask, list] : by_mask) {
    for (const auto& g : list) float64 = float64 || g.scalar_type() == torch::kFloat64;
  }
  return total.sqrt().to(float64 ? torch::kFloat64 : torch::kFloat32);
}

torch::Tensor ParallelizedModel::clip_grad_norm_(double max_norm) {
  LOOM_REQUIRE_USAGE(max_norm >= 0, "clip_grad_norm_ needs max_norm >= 0 (0: no clipping), got ", max_norm);
  const torch::Tensor norm = grad_norm();
  if (max_norm == 0) return norm;  // no clipping (TorchTitan's max_norm = 0); the norm is still reported
  std::vector<torch::Tensor> grads;
  for (const auto& g : parts_.storage->norm_gradients()) {
    if (g.defined() && g.numel() > 0) grads.push_back(g);
  }
  optim::clip_grads_with_norm_(grads, max_norm, norm);
  return norm;
}

std::unique_ptr<optim::Optimizer> ParallelizedModel::build_optimizer(const OptimizerSpec& spec,
                                                                     const OptimizerRequest& request,
                                                                     const c10::Device& device) {
  if (spec.check_layout) {
    OptimizerLayout layout;
    layout.device = device.str();
    parts_.storage->describe_layout(layout);
    for (const auto& s : parts_.synchronizers) s->describe_layout(layout);
    spec.check_layout(request, layout);
  }
  return parts_.storage->build_optimizer(spec, request);
}

ParameterLayouts ParallelizedModel::parameter_layouts() {
  ParameterLayouts layouts;
  for (const auto& m : parts_.modules) {
    for (const auto& p : m->named_parameters()) {
      if (p.slot->layout) layouts.emplace(p.name, *p.slot->layout);
    }
  }
  return layouts;
}

std::map<std::string, double> ParallelizedModel::step_metrics() const {
  std::map<std::string, double> out;
  for (const auto& s : parts_.synchronizers) s->add_metrics(out);
  return out;
}

void ParallelizedModel::add_to_state_dict(checkpoint::ShardedStateDict& state, optim::Optimizer& optimizer, bool frozen) {
  const ParameterLayouts layouts = parameter_layouts();
  parts_.storage->add_parameters(state, layouts, /*trainable=*/true);
  if (frozen) parts_.storage->add_parameters(state, layouts, /*trainable=*/false);
  parts_.storage->add_optimizer_state(state, optimizer, layouts);
  add_persistent_buffers(state);
}

void ParallelizedModel::add_base_to_state_dict(checkpoint::ShardedStateDict& state) {
  parts_.storage->add_parameters(state, parameter_layouts(), /*trainable=*/!has_frozen_parameters());
  add_persistent_buffers(state);
}

bool ParallelizedModel::has_frozen_parameters() { return parts_.storage->has_frozen_parameters(); }

void ParallelizedModel::add_persistent_buffers(checkpoint::ShardedStateDict& state) {
  // Persistent buffers (state the model learns outside the gradients, e.g. an MoE layer's
  // selection bias) are identical on every rank that holds their module: saved whole, loaded in place.
  for (const auto& module : parts_.modules) {
    for (const auto& b : module->named_buffers()) {
      if (b.slot->persistent) state.add_full(b.name, checkpoint::kModelComponent, b.slot->tensor);
    }
  }
}

void ParallelizedModel::load_full_parameters(const optim::TensorDict& full) {
  // Each parameter's piece of the other placements first (a TP box): what the storage holds whole.
  const ParameterLayouts layouts = parameter_layouts();
  // Persistent buffers named in `full` (an MoE layer's selection bias) are whole on every rank
  // that holds their module.
  std::set<std::string> buffers;
  torch::NoGradGuard no_grad;
  for (const auto& module : parts_.modules) {
    for (const auto& b : module->named_buffers()) {
      const auto it = full.find(b.name);
      if (!b.slot->persistent || it == full.end()) continue;
      b.slot->tensor.copy_(it->second);
      buffers.insert(b.name);
    }
  }
  optim::TensorDict pieces;
  for (const auto& [name, value] : full) {
    if (buffers.count(name)) continue;
    torch::Tensor piece = value;
    if (const auto it = layouts.find(name); it != layouts.end()) {
      const tensor::Box box = it->second.local_box();
      for (size_t d = 0; d < box.sizes.size(); ++d) {
        piece = piece.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
      }
    }
    pieces[name] = piece;
  }
  // Under a frozen base the values are the base's: the adapters keep their initialization.
  std::set<std::string> optional;
  if (has_frozen_parameters()) {
    for (const auto& module : parts_.modules) {
      for (const auto& p : module->named_parameters()) {
        if (p.slot->requires_grad) optional.insert(p.name);
      }
    }
  }
  parts_.storage->load_pieces(pieces, parts_.step->holds_model_parts(), optional);
}

}  // namespace loom::parallel
