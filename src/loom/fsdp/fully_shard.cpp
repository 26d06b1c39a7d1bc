#include "loom/fsdp/fully_shard.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <deque>
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

FSDPModule::FSDPModule(nn::Module& module, FSDPMesh mesh, FSDPPolicy policy)
    : module_(&module), mesh_(std::move(mesh)), policy_(std::move(policy)) {}

FSDPModule::~FSDPModule() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.states.find(module_);
  if (it != reg.states.end() && it->second.expired()) reg.states.erase(it);
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

torch::Tensor FSDPModule::pre_forward(torch::Tensor input) {
  if (is_root()) {
    root_pre_forward();
    const c10::ScalarType dtype = policy_.mixed_precision.param_dtype;
    if (input.defined() && input.is_floating_point() && input.scalar_type() != dtype) {
      input = input.to(dtype);
    }
  }
  RootContext& ctx = context();
  if (ctx.recording && !in_backward_) ctx.pre_forward_order.push_back(this);
  if (!group_) return input;
  group_->unshard_async();
  if (policy_.forward_prefetch && ctx.order_recorded && !in_backward_) {
    auto it = std::find(ctx.pre_forward_order.begin(), ctx.pre_forward_order.end(), this);
    if (it != ctx.pre_forward_order.end()) {
      for (++it; it != ctx.pre_forward_order.end(); ++it) {
        if ((*it)->group_) {
          ctx.prefetches.forward += prefetch(*(*it)->group_);
          break;
        }
      }
    }
  }
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
  RootContext& ctx = context();
  ctx.recording = !ctx.order_recorded;
  if (ctx.recording) {
    ctx.pre_forward_order.clear();
    ctx.post_forward_order.clear();
  }
}

torch::Tensor FSDPModule::post_forward(torch::Tensor output) {
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
    auto& order = ctx.post_forward_order;
    auto it = std::find(order.begin(), order.end(), this);
    while (it != order.end() && it != order.begin()) {
      --it;
      if ((*it)->group_) {
        ctx.prefetches.backward += prefetch(*(*it)->group_);
        break;
      }
    }
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
  LOOM_REQUIRE(mesh.shard != nullptr, "fully_shard needs an FSDPMesh with a shard group; fix: "
                                      "build it with make_fsdp_mesh(mesh, policy)");
  FSDPMesh group_mesh = mesh;
  if (!group_mesh.replicate) {
    group_mesh.replicate =
        distributed::Comm::single("dp_replicate", mesh.shard->world_rank_of(mesh.shard->rank()));
  }
  LOOM_REQUIRE(!fsdp_state(module), "module ", module.type_name(),
               " is already fully_shard-ed; fix: call fully_shard once per module");

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

  // FSDP modules below: their parameters are theirs.
  std::vector<std::pair<std::string, std::shared_ptr<FSDPModule>>> descendants;
  for (const auto& [path, m] : module.named_modules()) {
    if (path.empty()) continue;
    if (auto state = fsdp_state(*m)) descendants.emplace_back(path, std::move(state));
  }
  std::vector<std::pair<std::string, nn::ParameterSlot*>> params;
  for (const auto& p : module.named_parameters()) {
    const bool owned_below = std::any_of(descendants.begin(), descendants.end(),
                                         [&](const auto& d) { return has_prefix(p.name, d.first); });
    if (!owned_below) params.emplace_back(p.name, p.slot);
  }

  std::shared_ptr<FSDPModule> state(new FSDPModule(module, group_mesh, policy));
  if (!params.empty()) {
    state->group_ = std::make_unique<FSDPParamGroup>(name.empty() ? module.type_name() : name,
                                                     params, group_mesh, options);
    FSDPModule* raw = state.get();
    state->group_->set_on_grads_ready([raw] { raw->post_backward(); });
    state->group_->set_drain_pending(
        [raw] { raw->drain_reduces(raw->group_.get(), Progress::kWaitAll); });
  }
  state->attach(std::move(descendants));
  {
    auto& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mutex);
    reg.states[&module] = state;
  }
  // The hooks own the state: it lives as long as the module.
  state->pre_hook_ = module.add_forward_pre_hook(
      [state](nn::Module&, torch::Tensor input) { return state->pre_forward(std::move(input)); });
  state->post_hook_ = module.add_forward_post_hook(
      [state](nn::Module&, torch::Tensor, torch::Tensor output) {
        return state->post_forward(std::move(output));
      });
  return state;
}

std::shared_ptr<FSDPModule> fsdp_state(const nn::Module& module) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.states.find(&module);
  return it == reg.states.end() ? nullptr : it->second.lock();
}

}  // namespace loom::fsdp
