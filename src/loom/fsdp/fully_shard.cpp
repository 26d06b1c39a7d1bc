#include "loom/fsdp/fully_shard.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "loom/core/error.h"
#include "loom/optim/clip_grad.h"

namespace loom::fsdp {
namespace {

using Progress = FSDPParamGroup::Progress;

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

bool has_prefix(const std::string& name, const std::string& path) {
  return name.size() > path.size() && name.compare(0, path.size(), path) == 0 &&
         name[path.size()] == '.';
}

// Module -> its FSDP state. The module's hooks own the state; the registry only finds it (to
// exclude a sharded child's parameters from its parent's group).
struct Registry {
  std::mutex mutex;
  std::unordered_map<const nn::Module*, std::weak_ptr<FSDPModule>> states;
};
Registry& registry() {
  static Registry r;
  return r;
}

std::string ranks_str(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s + "]";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Policy

ReshardAfterForward ReshardAfterForward::degree(int n) {
  LOOM_REQUIRE_USAGE(n >= 1, "reshard_after_forward degree must be >= 1, got ", n,
                     "; fix: use true, false or a divisor of the shard size");
  return ReshardAfterForward(n);
}

ReshardAfterForward ReshardAfterForward::parse(const std::string& text) {
  if (text == "true" || text == "always") return always();
  if (text == "false" || text == "never") return never();
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  LOOM_REQUIRE_USAGE(digits && text.size() < 10, "reshard_after_forward '", text,
                     "' is not one of true, false, always, never or a positive integer");
  return degree(std::stoi(text));
}

std::string ReshardAfterForward::str() const {
  if (value_ < 0) return "true";
  if (value_ == 0) return "false";
  return std::to_string(value_);
}

namespace {

// Resolves the policy's reshard setting against the shard size W: N = W is a full reshard, N = 1
// none.
void resolve_reshard(const ReshardAfterForward& r, int world, GroupOptions& options) {
  options.post_forward_degree = 0;
  if (!r.is_degree()) {
    options.reshard_after_forward = r == ReshardAfterForward::always();
    return;
  }
  const int n = r.degree();
  LOOM_REQUIRE_USAGE(world % n == 0, "reshard_after_forward = ", n,
                     " does not divide the FSDP shard size ", world,
                     "; fix: use a divisor of ", world, " (e.g. the ranks per node) or true/false");
  options.reshard_after_forward = n > 1;
  if (n > 1 && n < world) options.post_forward_degree = n;
}

}  // namespace

FSDPMesh make_fsdp_mesh(const distributed::DeviceMesh& mesh, const FSDPPolicy& policy) {
  static const std::set<std::string> droppable = {"dp_shard", "dp_shard_cp", "dp_replicate"};
  auto resolve = [&](const std::string& dim, const char* role) {
    if (mesh.has(dim)) return mesh.comm(dim);
    LOOM_REQUIRE_USAGE(droppable.count(dim) > 0, "FSDP ", role, " dim '", dim,
                       "' is not a dim of the mesh (", mesh.layout().describe(),
                       "); fix: name a mesh dim such as dp_shard / dp_replicate");
    return distributed::Comm::single(dim, mesh.rank());
  };
  FSDPMesh out;
  out.shard = resolve(policy.shard_dim, "shard");
  out.replicate = resolve(policy.replicate_dim, "replicate");
  if (out.shard->size() > 1 && out.replicate->size() > 1) {
    // HSDP: the shard group and the replica group must meet in this rank only (orthogonal mesh
    // dims); otherwise gradients would be summed twice over some ranks.
    std::vector<int> common;
    std::vector<int> a = out.shard->world_ranks(), b = out.replicate->world_ranks();
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
    LOOM_REQUIRE_USAGE(common.size() == 1, "FSDP mesh mismatch: shard dim '", policy.shard_dim,
                       "' ", ranks_str(out.shard->world_ranks()), " and replicate dim '",
                       policy.replicate_dim, "' ", ranks_str(out.replicate->world_ranks()),
                       " share ranks ", ranks_str(common),
                       "; fix: shard over dp_shard and replicate over dp_replicate of one mesh");
  }
  GroupOptions resolved;
  resolve_reshard(policy.reshard_after_forward, out.shard->size(), resolved);
  if (resolved.post_forward_degree > 1) {
    // hpZ: the N consecutive ranks of the shard group (neighbours: the same node when N is the
    // ranks per node) hold the whole buffer between forward and backward.
    const int n = resolved.post_forward_degree;
    const int base = out.shard->rank() / n * n;
    std::vector<int> ranks;
    for (int i = 0; i < n; ++i) ranks.push_back(out.shard->world_rank_of(base + i));
    out.post_forward = mesh.dist()->new_group(ranks, policy.shard_dim + "_hpz");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Root runtime state

struct FSDPModule::RootContext {
  // The order in which states start (pre) and finish (post) their forward, recorded during the
  // first forward: forward prefetch follows the first, backward prefetch the reverse of the second.
  std::vector<FSDPModule*> pre_forward_order;
  std::vector<FSDPModule*> post_forward_order;
  bool recording = false;
  bool order_recorded = false;
  bool callback_queued = false;
  // Groups with a reduction in flight, in issue order (= the order on every rank); shared by the
  // roots of one rank's pipeline stages (share_reductions).
  std::shared_ptr<std::deque<FSDPParamGroup*>> pending = std::make_shared<std::deque<FSDPParamGroup*>>();
  PrefetchCounts prefetches;
};

// ---------------------------------------------------------------------------------------------
// FSDPModule

FSDPModule::FSDPModule(std::vector<Member> members, FSDPMesh mesh, FSDPPolicy policy)
    : members_(std::move(members)), mesh_(std::move(mesh)), policy_(std::move(policy)) {}

FSDPModule::~FSDPModule() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  for (const Member& m : members_) {
    auto it = reg.states.find(m.module);
    if (it != reg.states.end() && it->second.expired()) reg.states.erase(it);
  }
}

std::vector<nn::Module*> FSDPModule::modules() const {
  std::vector<nn::Module*> out;
  for (const Member& m : members_) out.push_back(m.module);
  return out;
}

std::shared_ptr<FSDPModule> FSDPModule::root() {
  if (auto r = root_.lock()) return r;
  return shared_from_this();
}

FSDPModule::RootContext& FSDPModule::context() {
  auto r = root();
  if (!r->context_) r->context_ = std::make_unique<RootContext>();
  return *r->context_;
}

void FSDPModule::attach(
    std::vector<std::pair<std::string, std::shared_ptr<FSDPModule>>> descendants) {
  descendants_ = std::move(descendants);
  for (auto& [path, state] : descendants_) {
    state->root_ = weak_from_this();
    state->fqn_ = path;
    state->context_.reset();  // runtime state now lives in this (the new root)
  }
}

std::vector<std::shared_ptr<FSDPModule>> FSDPModule::states() {
  std::vector<std::shared_ptr<FSDPModule>> out{shared_from_this()};
  for (const auto& [path, state] : descendants_) out.push_back(state);
  return out;
}

std::vector<FSDPParamGroup*> FSDPModule::param_groups() {
  std::vector<FSDPParamGroup*> out;
  for (const auto& s : states()) {
    if (s->group_) out.push_back(s->group_.get());
  }
  return out;
}

std::string FSDPModule::param_fqn(const FSDPParamGroup& group, const FSDPParamGroup::Param& p) {
  for (const auto& s : states()) {
    if (s->group_.get() == &group) return join(s->fqn_, p.name);
  }
  fail("FSDP group '", group.name(), "' is not below this FSDP module");
}

// ---- Hooks ----

torch::Tensor FSDPModule::pre_forward(size_t member, torch::Tensor input) {
  if (!forward_open_) {
    forward_open_ = true;
    for (Member& m : members_) m.ran = false;
    members_[member].ran = true;
    return group_pre_forward(std::move(input));
  }
  // A later module of the group: its first gathered the parameters (a no-op unless something
  // resharded them in between).
  members_[member].ran = true;
  if (group_) {
    group_->unshard_async();
    group_->wait_for_unshard();
  }
  return input;
}

torch::Tensor FSDPModule::post_forward(size_t member, torch::Tensor output) {
  members_[member].ran = true;
  const bool last = std::all_of(members_.begin(), members_.end(), [](const Member& m) { return m.ran; });
  if (!last) return output;  // the group's forward ends with the last of its modules'
  forward_open_ = false;
  return group_post_forward(std::move(output));
}

template <typename It>
int64_t FSDPModule::prefetch_after(It begin, It end, int depth) const {
  It it = std::find(begin, end, this);
  if (it == end) return 0;
  int64_t issued = 0;
  for (++it; it != end && depth > 0; ++it) {
    if (!(*it)->group_) continue;
    issued += prefetch(*(*it)->group_);
    --depth;  // a group already gathered or in flight still counts towards the depth
  }
  return issued;
}

torch::Tensor FSDPModule::group_pre_forward(torch::Tensor input) {
  if (is_root()) {
    root_pre_forward();
    const c10::ScalarType dtype = policy_.mixed_precision.param_dtype;
    if (input.defined() && input.is_floating_point() && input.scalar_type() != dtype) {
      input = input.to(dtype);
    }
  }
  RootContext& ctx = context();
  if (ctx.recording && !in_backward_) ctx.pre_forward_order.push_back(this);
  // Own all-gather first, then the next groups' (every rank issues them in this order).
  if (group_) group_->unshard_async();
  if (policy_.forward_prefetch && ctx.order_recorded && !in_backward_) {
    const auto& order = ctx.pre_forward_order;
    ctx.prefetches.forward += prefetch_after(order.begin(), order.end(), policy_.prefetch_depth);
  }
  if (!group_) return input;
  // A module's nested groups (an MoE layer's experts, sharded over their own mesh inside a block)
  // are gathered with it: an around-hook on the module sees the parameters its forward will read,
  // which activation checkpointing takes as its inputs (their gradients reach FSDP through them).
  // Not for the root, whose nested groups are the blocks.
  std::vector<FSDPParamGroup*> nested;
  if (!is_root()) {
    for (const auto& state : states()) {
      if (state.get() != this && state->group_ && !state->group_->is_unsharded()) {
        state->group_->unshard_async();
        nested.push_back(state->group_.get());
      }
    }
  }
  group_->wait_for_unshard();
  for (FSDPParamGroup* g : nested) g->wait_for_unshard();
  return input;
}

bool FSDPModule::prefetch(FSDPParamGroup& target) {
  if (target.is_unsharded() || target.is_gathering()) return false;
  target.unshard_async();
  return true;
}

FSDPModule::PrefetchCounts FSDPModule::prefetch_counts() { return context().prefetches; }

void FSDPModule::reset_prefetch_counts() { context().prefetches = {}; }

void FSDPModule::root_pre_forward() {
  // A group whose forward began but never ended (one of its modules did not run) starts afresh.
  for (const auto& s : states()) {
    if (s.get() != this) s->forward_open_ = false;
  }
  RootContext& ctx = context();
  ctx.recording = !ctx.order_recorded;
  if (ctx.recording) {
    ctx.pre_forward_order.clear();
    ctx.post_forward_order.clear();
  }
}

torch::Tensor FSDPModule::group_post_forward(torch::Tensor output) {
  RootContext& ctx = context();
  const bool root = is_root();
  if (ctx.recording && !in_backward_) ctx.post_forward_order.push_back(this);
  if (root && policy_.mixed_precision.cast_root_output && output.defined() &&
      output.is_floating_point() && output.scalar_type() != torch::kFloat32) {
    output = output.to(torch::kFloat32);
  }
  const bool backward_follows =
      output.defined() && output.requires_grad() && torch::GradMode::is_enabled();
  if (group_ && !in_backward_ && reshard_after_forward_) {
    if (!backward_follows) {
      group_->reshard();  // no backward will come for this forward
    } else if (!root) {
      // The root keeps its parameters: backward starts with them (FSDP2 does the same).
      group_->reshard_after_forward();
    }
  }
  if (backward_follows && !in_backward_) {
    std::weak_ptr<FSDPModule> weak = weak_from_this();
    output.register_hook([weak](const torch::Tensor&) {
      if (auto self = weak.lock()) self->pre_backward();
    });
  }
  if (root) {
    if (ctx.recording) ctx.order_recorded = true;
    ctx.recording = false;
  }
  return output;
}

void FSDPModule::pre_backward() {
  RootContext& ctx = context();
  if (is_root() && !ctx.callback_queued) {
    // Runs when the whole backward is done: issues what unused parameters left outstanding.
    std::weak_ptr<FSDPModule> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto self = weak.lock()) self->root_post_backward_callback();
    });
    ctx.callback_queued = true;
  }
  if (!group_ || in_backward_) return;
  in_backward_ = true;
  group_->mark_backward_started();
  group_->unshard_async();
  if (policy_.backward_prefetch && ctx.order_recorded) {
    // Backward runs groups in the reverse order of their forward's end.
    const auto& order = ctx.post_forward_order;
    ctx.prefetches.backward += prefetch_after(order.rbegin(), order.rend(), policy_.prefetch_depth);
  }
  group_->wait_for_unshard();
  if (group_->has_trainable()) group_->prepare_unsharded_grads();
}

void FSDPModule::post_backward() {
  in_backward_ = false;
  if (reshard_after_backward_) group_->reshard();
  if (requires_gradient_sync_ && group_->has_trainable()) {
    group_->reduce_grads_async();
    context().pending->push_back(group_.get());
  }
  group_->reset_backward_state();
  poll_reduces();
}

void FSDPModule::root_post_backward_callback() {
  context().callback_queued = false;
  complete_backward();
}

void FSDPModule::complete_backward() {
  auto all = root()->states();
  // Groups whose backward ran but not for every parameter (unused parameters, or a backward that
  // did not start at the root's output): reduce what they have, in one fixed order so every rank
  // issues the same collectives.
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    FSDPModule& s = **it;
    if (s.group_ && (s.in_backward_ || s.group_->backward_started())) s.post_backward();
  }
  for (auto& s : all) {
    if (s->group_ && s->reshard_after_backward_) s->group_->reshard();
    s->in_backward_ = false;
  }
}

// ---- Reductions ----

void FSDPModule::drain_reduces(FSDPParamGroup* through, Progress progress) {
  auto& queue = *context().pending;
  bool may_issue_all_reduce = true;
  for (auto it = queue.begin(); it != queue.end();) {
    FSDPParamGroup* g = *it;
    const bool done = g->advance_reduce(progress, may_issue_all_reduce);
    if (!done && g->mesh().replicate_size() > 1 && !g->pending_all_reduce_issued()) {
      may_issue_all_reduce = false;  // keep the all-reduces in queue order
    }
    it = done ? queue.erase(it) : std::next(it);
    if (g == through) break;
  }
}

void FSDPModule::poll_reduces() { drain_reduces(nullptr, Progress::kPoll); }

void FSDPModule::finalize_backward() {
  // Normally a no-op: the end-of-backward callback has done it.
  complete_backward();
  // Let every reduce-scatter finish and issue the HSDP all-reduces in order, then wait for those.
  drain_reduces(nullptr, Progress::kWaitReduceScatter);
  drain_reduces(nullptr, Progress::kWaitAll);
  TORCH_INTERNAL_ASSERT(context().pending->empty(), "FSDP reductions left after finalize");
}

// ---- Explicit control ----

void FSDPModule::unshard() {
  auto groups = param_groups();
  for (FSDPParamGroup* g : groups) g->unshard_async();
  for (FSDPParamGroup* g : groups) g->wait_for_unshard();
}

void FSDPModule::unshard_async() {
  for (FSDPParamGroup* g : param_groups()) g->unshard_async();
}

void FSDPModule::reshard() {
  for (FSDPParamGroup* g : param_groups()) g->reshard();
}

void FSDPModule::set_reshard_after_forward(bool enabled) {
  for (auto& s : states()) s->reshard_after_forward_ = enabled;
}

void FSDPModule::reduce_gradients() {
  const auto all = states();
  for (const auto& s : all) {
    s->in_backward_ = false;
    if (s->group_) s->group_->reset_backward_state();
  }
  auto& queue = *context().pending;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    FSDPParamGroup* g = (*it)->group_.get();
    if (g == nullptr || !g->has_trainable()) continue;
    g->reduce_grads_async();
    queue.push_back(g);
  }
  poll_reduces();
}

void FSDPModule::share_reductions(const std::vector<std::shared_ptr<FSDPModule>>& roots) {
  if (roots.empty()) return;
  for (const auto& r : roots) {
    LOOM_REQUIRE(r->is_root(), "share_reductions: '", r->fqn(), "' is not an FSDP root");
    LOOM_REQUIRE(r->context().pending->empty(), "share_reductions with reductions in flight");
  }
  const auto queue = roots.front()->context().pending;
  for (const auto& r : roots) r->context().pending = queue;
}

void FSDPModule::set_requires_gradient_sync(bool enabled) {
  for (auto& s : states()) s->requires_gradient_sync_ = enabled;
}

bool FSDPModule::requires_gradient_sync() const { return requires_gradient_sync_; }

void FSDPModule::set_reshard_after_backward(bool enabled) {
  for (auto& s : states()) s->reshard_after_backward_ = enabled;
}

// ---- Gradients ----

void FSDPModule::zero_grad() {
  finalize_backward();
  for (FSDPParamGroup* g : param_groups()) g->zero_grad();
}

namespace {
std::vector<torch::Tensor> shard_grads(const std::vector<FSDPParamGroup*>& groups) {
  std::vector<torch::Tensor> grads;
  for (FSDPParamGroup* g : groups) grads.push_back(g->sharded_grads());
  return grads;
}
}  // namespace

torch::Tensor FSDPModule::grad_norm() {
  finalize_backward();
  auto groups = param_groups();
  for (FSDPParamGroup* g : groups) {
    LOOM_REQUIRE(g->mesh().shard == mesh_.shard, "FSDP group '", g->name(),
                 "' shards over another group than its root; fix: fully_shard every module with "
                 "the same FSDPMesh");
  }
  // Padding is zero, so the flat shards' squares sum to exactly this rank's share.
  auto comm = mesh_.shard;
  return optim::total_grad_norm(shard_grads(groups), [comm](torch::Tensor& sum_of_squares) {
    comm->all_reduce(sum_of_squares, distributed::ReduceOp::kSum);
  });
}

torch::Tensor FSDPModule::clip_grad_norm_(double max_norm) {
  LOOM_REQUIRE_USAGE(max_norm > 0, "clip_grad_norm_ needs max_norm > 0, got ", max_norm);
  torch::Tensor norm = grad_norm();
  optim::clip_grads_with_norm_(shard_grads(param_groups()), max_norm, norm);
  return norm;
}

// ---- Values ----

optim::TensorDict FSDPModule::full_state_dict() {
  optim::TensorDict out;
  for (FSDPParamGroup* g : param_groups()) {
    std::vector<torch::Tensor> full = g->gather_full_params();
    for (size_t i = 0; i < full.size(); ++i) out[param_fqn(*g, g->params()[i])] = full[i];
  }
  return out;
}

void FSDPModule::load_full_state_dict(const optim::TensorDict& full, const std::set<std::string>& optional) {
  reshard();
  size_t used = 0;
  for (FSDPParamGroup* g : param_groups()) {
    for (size_t i = 0; i < g->params().size(); ++i) {
      const std::string name = param_fqn(*g, g->params()[i]);
      auto it = full.find(name);
      if (it == full.end() && optional.count(name)) continue;
      LOOM_REQUIRE(it != full.end(), "FSDP load_full_state_dict: parameter '", name,
                   "' is missing from the state dict");
      g->load_full_param(i, it->second);
      ++used;
    }
  }
  if (used != full.size()) {
    std::set<std::string> known;
    for (FSDPParamGroup* g : param_groups()) {
      for (const auto& p : g->params()) known.insert(param_fqn(*g, p));
    }
    for (const auto& [name, t] : full) {
      LOOM_REQUIRE(known.count(name) > 0, "FSDP load_full_state_dict: unexpected entry '", name,
                   "' (no such sharded parameter)");
    }
  }
}

void FSDPModule::init_parameters(
    const std::function<void(const std::string& fqn, torch::Tensor& full)>& fill) {
  reshard();
  for (FSDPParamGroup* g : param_groups()) {
    for (size_t i = 0; i < g->params().size(); ++i) {
      const auto& p = g->params()[i];
      torch::Tensor full = torch::empty(g->plan().tensors[p.index].shape, torch::kFloat32);
      fill(param_fqn(*g, p), full);
      g->load_full_param(i, full);
    }
  }
}

std::vector<ShardedTensor> FSDPModule::sharded_state_dict() {
  std::vector<ShardedTensor> out;
  for (FSDPParamGroup* g : param_groups()) {
    for (const auto& p : g->params()) {
      out.push_back({param_fqn(*g, p), p.sharded, g->plan().tensors[p.index].shape,
                     g->params_buffer().global_range(p.index).begin, p.trainable});
    }
  }
  return out;
}

int64_t FSDPModule::sharded_bytes() {
  int64_t bytes = 0;
  for (FSDPParamGroup* g : param_groups()) bytes += g->sharded_bytes();
  return bytes;
}

int64_t FSDPModule::unsharded_bytes_allocated() {
  int64_t bytes = 0;
  for (FSDPParamGroup* g : param_groups()) bytes += g->unsharded_bytes_allocated();
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// FSDPRoots

FSDPRoots::FSDPRoots(std::shared_ptr<FSDPModule> root) {
  if (root) roots_.push_back(std::move(root));
}

FSDPRoots::FSDPRoots(std::vector<std::shared_ptr<FSDPModule>> roots) : roots_(std::move(roots)) {
  for (const auto& r : roots_) LOOM_REQUIRE(r != nullptr && r->is_root(), "FSDPRoots takes FSDP roots");
}

std::vector<FSDPParamGroup*> FSDPRoots::param_groups() const {
  std::vector<FSDPParamGroup*> out;
  for (const auto& r : roots_) {
    for (FSDPParamGroup* g : r->param_groups()) out.push_back(g);
  }
  return out;
}

std::string FSDPRoots::param_fqn(const FSDPParamGroup& group, const FSDPParamGroup::Param& p) const {
  for (const auto& r : roots_) {
    for (FSDPParamGroup* g : r->param_groups()) {
      if (g == &group) return r->param_fqn(group, p);
    }
  }
  fail("FSDP group '", group.name(), "' is not below these FSDP roots");
}

void FSDPRoots::finalize_backward() const {
  for (const auto& r : roots_) r->finalize_backward();
}

void FSDPRoots::zero_grad() const {
  for (const auto& r : roots_) r->zero_grad();
}

std::vector<ShardedTensor> FSDPRoots::sharded_state_dict() const {
  std::vector<ShardedTensor> out;
  for (const auto& r : roots_) {
    for (auto& t : r->sharded_state_dict()) out.push_back(std::move(t));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// fully_shard

std::shared_ptr<FSDPModule> fully_shard(nn::Module& module, const FSDPMesh& mesh,
                                        const FSDPPolicy& policy, const std::string& name) {
  return fully_shard({{"", &module}}, mesh, policy, name.empty() ? module.type_name() : name);
}

namespace {

// The path of the module `state`'s given paths are relative to, from the module at whose path
// `found` one of its members, `member`, was found ("layers.0" found at "layers.0" -> "").
std::string group_base(const FSDPModule& state, const nn::Module* member, const std::string& found,
                       const std::vector<std::pair<const nn::Module*, std::string>>& member_paths) {
  for (const auto& [m, path] : member_paths) {
    if (m != member) continue;
    if (path.empty()) return found;
    const bool suffix = found.size() >= path.size() &&
                        found.compare(found.size() - path.size(), path.size(), path) == 0 &&
                        (found.size() == path.size() || found[found.size() - path.size() - 1] == '.');
    LOOM_REQUIRE(suffix, "FSDP group '", state.param_group() ? state.param_group()->name() : "?",
                 "' was given path '", path, "' for a module found at '", found,
                 "'; fix: give fully_shard each module's path from one common ancestor");
    return found.substr(0, found.size() == path.size() ? 0 : found.size() - path.size() - 1);
  }
  fail("module at '", found, "' is not a member of its FSDP group");
}

}  // namespace

std::shared_ptr<FSDPModule> fully_shard(const std::vector<std::pair<std::string, nn::Module*>>& modules,
                                        const FSDPMesh& mesh, const FSDPPolicy& policy, const std::string& name) {
  LOOM_REQUIRE(mesh.shard != nullptr, "fully_shard needs an FSDPMesh with a shard group; fix: "
                                      "build it with make_fsdp_mesh(mesh, policy)");
  LOOM_REQUIRE(!modules.empty(), "fully_shard needs at least one module");
  FSDPMesh group_mesh = mesh;
  if (!group_mesh.replicate) {
    group_mesh.replicate =
        distributed::Comm::single("dp_replicate", mesh.shard->world_rank_of(mesh.shard->rank()));
  }
  std::set<const nn::Module*> listed;
  std::set<std::string> paths;
  for (const auto& [path, m] : modules) {
    LOOM_REQUIRE(m != nullptr, "fully_shard got a null module");
    LOOM_REQUIRE(!fsdp_state(*m), "module ", path.empty() ? m->type_name() : path,
                 " is already fully_shard-ed; fix: call fully_shard once per module");
    LOOM_REQUIRE(listed.insert(m).second && paths.insert(path).second, "fully_shard lists module '", path,
                 "' twice");
    LOOM_REQUIRE(modules.size() == 1 || !path.empty(), "fully_shard of several modules needs each one's path "
                 "from a common ancestor (the prefix of its parameters' names)");
  }
  for (const auto& [path, m] : modules) {
    for (const auto& [sub, inner] : m->named_modules()) {
      LOOM_REQUIRE(sub.empty() || listed.count(inner) == 0, "fully_shard: module '", join(path, sub),
                   "' is inside '", path, "', also listed; fix: list modules none of which contains another");
    }
  }
  std::string label = name;
  if (label.empty()) {
    for (const auto& [path, m] : modules) label += (label.empty() ? "" : "+") + path;
  }

  GroupOptions options;
  options.granularity = policy.granularity;
  options.parameter_granularity = policy.parameter_granularity;
  options.planner = policy.planner;
  options.param_dtype = policy.mixed_precision.param_dtype;
  options.reduce_dtype = policy.mixed_precision.reduce_dtype;
  options.device = policy.device;
  resolve_reshard(policy.reshard_after_forward, group_mesh.shard_size(), options);
  options.gradient_divide_factor =
      policy.gradient_divide_factor.value_or(group_mesh.shard_size() * group_mesh.replicate_size());
  LOOM_REQUIRE_USAGE(options.gradient_divide_factor > 0,
                     "FSDP gradient_divide_factor must be > 0, got ",
                     options.gradient_divide_factor);
  LOOM_REQUIRE_USAGE(
      at::isFloatingType(options.param_dtype) && at::isFloatingType(options.reduce_dtype),
      "FSDP mixed precision needs floating-point dtypes, got param ", options.param_dtype,
      " and reduce ", options.reduce_dtype);
  LOOM_REQUIRE_USAGE(policy.prefetch_depth >= 0, "FSDP prefetch_depth must be >= 0, got ", policy.prefetch_depth,
                     "; fix: 1 prefetches the next group, 0 none");

  // FSDP modules below: their parameters are theirs. A group of several modules below appears once
  // (at the path its members' paths are relative to), after all of its members were found here.
  std::vector<std::pair<std::string, std::shared_ptr<FSDPModule>>> descendants;
  std::map<const FSDPModule*, size_t> members_found;
  std::vector<std::pair<std::string, nn::ParameterSlot*>> params;
  for (const auto& [path, m] : modules) {
    std::vector<std::string> owned;  // paths below `m` of modules sharded already
    for (const auto& [sub, inner] : m->named_modules()) {
      if (sub.empty()) continue;
      auto state = fsdp_state(*inner);
      if (!state) continue;
      owned.push_back(sub);
      if (members_found[state.get()]++ > 0) continue;
      std::vector<std::pair<const nn::Module*, std::string>> member_paths;
      for (const auto& member : state->members_) member_paths.emplace_back(member.module, member.path);
      descendants.emplace_back(group_base(*state, inner, join(path, sub), member_paths), std::move(state));
    }
    for (const auto& p : m->named_parameters()) {
      const bool owned_below =
          std::any_of(owned.begin(), owned.end(), [&](const std::string& sub) { return has_prefix(p.name, sub); });
      if (!owned_below) params.emplace_back(join(path, p.name), p.slot);
    }
  }
  for (const auto& [path, state] : descendants) {
    LOOM_REQUIRE(members_found[state.get()] == state->members_.size(), "FSDP group '", path,
                 "' has modules both inside and outside the modules being sharded; fix: shard the "
                 "modules that contain all of a group's modules");
  }

  std::vector<FSDPModule::Member> members;
  for (const auto& [path, m] : modules) members.push_back({m, path});
  std::shared_ptr<FSDPModule> state(new FSDPModule(std::move(members), group_mesh, policy));
  if (!params.empty()) {
    state->group_ = std::make_unique<FSDPParamGroup>(label, params, group_mesh, options);
    FSDPModule* raw = state.get();
    state->group_->set_on_grads_ready([raw] { raw->post_backward(); });
    state->group_->set_drain_pending(
        [raw] { raw->drain_reduces(raw->group_.get(), Progress::kWaitAll); });
  }
  state->attach(std::move(descendants));
  {
    auto& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mutex);
    for (const auto& [path, m] : modules) reg.states[m] = state;
  }
  // The hooks own the state: it lives as long as its modules. They are state-only (nn::HookKind):
  // they pass values through, except for the root's mixed-precision casts, which hold for whatever
  // runs in a module's place (nn::Module::run_between_hooks).
  for (size_t k = 0; k < state->members_.size(); ++k) {
    nn::Module& m = *state->members_[k].module;
    state->members_[k].pre_hook = m.add_forward_pre_hook(
        [state, k](nn::Module&, torch::Tensor input) { return state->pre_forward(k, std::move(input)); },
        nn::HookKind::kStateOnly);
    state->members_[k].post_hook = m.add_forward_post_hook(
        [state, k](nn::Module&, torch::Tensor, torch::Tensor output) {
          return state->post_forward(k, std::move(output));
        },
        nn::HookKind::kStateOnly);
  }
  return state;
}

std::vector<std::pair<size_t, size_t>> plan_buckets(const std::vector<int64_t>& bytes, int64_t target_bytes) {
  std::vector<std::pair<size_t, size_t>> buckets;
  int64_t open = 0;  // bytes of the open bucket [buckets.back().first, i)
  for (size_t i = 0; i < bytes.size(); ++i) {
    LOOM_REQUIRE(bytes[i] >= 0, "plan_buckets: unit ", i, " has ", bytes[i], " bytes");
    // Joining leaves the bucket at open + u, |open + u - T| against T - open for closing it: join
    // when 2 open + u <= 2 T (ties join: fewer collectives).
    const bool join_open = !buckets.empty() && target_bytes > 0 && open < target_bytes &&
                           2 * open + bytes[i] <= 2 * target_bytes;
    if (join_open) {
      buckets.back().second = i + 1;
      open += bytes[i];
    } else {
      buckets.emplace_back(i, i + 1);
      open = bytes[i];
    }
  }
  return buckets;
}

std::shared_ptr<FSDPModule> fsdp_state(const nn::Module& module) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.states.find(&module);
  return it == reg.states.end() ? nullptr : it->second.lock();
}

}  // namespace loom::fsdp
