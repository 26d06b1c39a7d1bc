#include "loom/parallel/parallelized_model.h"

#include <set>

#include <ATen/record_function.h>

#include <algorithm>

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/optim/clip_grad.h"

namespace loom::parallel {
namespace {

// Sum of squares of a list of gradients, fp32, on their device (zero for an empty list).
torch::Tensor sum_of_squares(const std::vector<torch::Tensor>& grads, const torch::TensorOptions& options) {
  if (grads.empty()) return torch::zeros({}, options);
  std::vector<torch::Tensor> norms = at::_foreach_norm(grads, 2);
  for (auto& n : norms) n = n.to(torch::kFloat32);
  return at::stack(norms).pow(2).sum();
}

}  // namespace

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
  // The groups each gradient's squares are summed over, outer to inner (the order finish runs):
  // the storage's (FSDP's shard group), then each parallelism's, innermost last.
  auto comms_of = [&](const std::string& name) {
    std::vector<tensor::CommPtr> comms;
    if (auto c = storage.norm_comm(name)) comms.push_back(c);
    for (auto it = parts_.synchronizers.rbegin(); it != parts_.synchronizers.rend(); ++it) {
      if (auto c = (*it)->norm_comm(name)) comms.push_back(c);
    }
    return comms;
  };
  struct Group {
    std::vector<tensor::CommPtr> comms;
    std::vector<torch::Tensor> grads;
    torch::Tensor squares;
  };
  std::vector<Group> groups;
  const NamedGradients grads = storage.local_gradients();
  torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32);
  for (const auto& [name, g] : grads) {
    auto comms = comms_of(name);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& group) { return group.comms == comms; });
    if (it == groups.end()) {
      groups.push_back({std::move(comms), {}, {}});
      it = groups.end() - 1;
    }
    if (!g.defined() || g.numel() == 0) continue;
    options = options.device(g.device());
    it->grads.push_back(g);
  }
  if (groups.size() <= 1) {
    // Every gradient summed over the same groups: PyTorch's clip_grad_norm_ over the storage's
    // tensors (FSDP: its flat shards), the squares reduced over each group in turn.
    const std::vector<tensor::CommPtr> comms = groups.empty() ? comms_of("") : groups.front().comms;
    return optim::total_grad_norm(storage.norm_gradients(), [&comms](torch::Tensor& sum_of_squares) {
      for (const auto& c : comms) c->all_reduce(sum_of_squares, distributed::ReduceOp::kSum);
    });
  }
  // Groups that differ: each group's squares, reduced over one group of ranks at a time, outer to
  // inner; the groups whose remaining ranks agree are added first, so each all-reduce carries every
  // group that needs it stacked in one tensor.
  for (Group& group : groups) group.squares = sum_of_squares(group.grads, options);
  std::vector<tensor::CommPtr> order;
  for (const Group& group : groups) {
    for (const auto& c : group.comms) {
      if (std::find(order.begin(), order.end(), c) == order.end()) order.push_back(c);
    }
  }
  // The groups' remaining ranks after the first `done` of `order` are reduced.
  auto remaining = [&](const Group& group, size_t done) {
    std::vector<tensor::CommPtr> out;
    for (const auto& c : group.comms) {
      if (std::find(order.begin(), order.begin() + static_cast<int64_t>(done), c) == order.begin() + static_cast<int64_t>(done)) {
        out.push_back(c);
      }
    }
    return out;
  };
  for (size_t done = 0; done < order.size(); ++done) {
    // Merge the groups left with the same ranks to reduce over.
    for (size_t a = 0; a < groups.size(); ++a) {
      for (size_t b = a + 1; b < groups.size();) {
        if (remaining(groups[a], done) == remaining(groups[b], done)) {
          groups[a].squares = groups[a].squares + groups[b].squares;
          groups.erase(groups.begin() + static_cast<int64_t>(b));
        } else {
          ++b;
        }
      }
    }
    const tensor::CommPtr& comm = order[done];
    std::vector<size_t> members;
    for (size_t i = 0; i < groups.size(); ++i) {
      const auto& c = groups[i].comms;
      if (std::find(c.begin(), c.end(), comm) != c.end()) members.push_back(i);
    }
    std::vector<torch::Tensor> parts;
    for (size_t i : members) parts.push_back(groups[i].squares.reshape({1}));
    torch::Tensor stacked = at::cat(parts);
    comm->all_reduce(stacked, distributed::ReduceOp::kSum);
    for (size_t j = 0; j < members.size(); ++j) groups[members[j]].squares = stacked.narrow(0, j, 1).reshape({});
  }
  torch::Tensor total = groups.front().squares;
  for (size_t i = 1; i < groups.size(); ++i) total = total + groups[i].squares;
  return total.sqrt();
}

torch::Tensor ParallelizedModel::clip_grad_norm_(double max_norm) {
  LOOM_REQUIRE_USAGE(max_norm > 0, "clip_grad_norm_ needs max_norm > 0, got ", max_norm);
  const torch::Tensor norm = grad_norm();
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
