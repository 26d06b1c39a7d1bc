#include "loom/fsdp/param_group.h"

#include <ATen/record_function.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "loom/core/error.h"

namespace loom::fsdp {
namespace {

int64_t element_size(c10::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

}  // namespace

FSDPMesh FSDPMesh::single(int world_rank) {
  FSDPMesh mesh;
  mesh.shard = distributed::Comm::single("dp_shard", world_rank);
  mesh.replicate = distributed::Comm::single("dp_replicate", world_rank);
  return mesh;
}

namespace {

using NamedSlots = std::vector<std::pair<std::string, nn::ParameterSlot*>>;

// The group's dtype comes from its first parameter (all must agree, see group_spec); its device
// from the options.
const torch::Tensor& first_param(const std::string& group, const NamedSlots& params) {
  LOOM_REQUIRE(!params.empty(), "FSDP group '", group, "' has no parameters");
  return params.front().second->tensor;
}

// The plan input of a group: one tensor per parameter, all in the smallest element size among the
// shard, all-gather and reduce dtypes, so the per-rank size S is 16-byte aligned for all three.
GroupSpec group_spec(const std::string& name, const NamedSlots& params,
                     const GroupOptions& options) {
  GroupSpec spec;
  spec.name = name.empty() ? "root" : name;
  const c10::ScalarType dtype = first_param(spec.name, params).scalar_type();
  const int64_t bytes = std::min({element_size(dtype), element_size(options.param_dtype),
                                  element_size(options.reduce_dtype)});
  for (const auto& [param_name, slot] : params) {
    const torch::Tensor& t = slot->tensor;
    LOOM_REQUIRE(t.defined(), "FSDP group '", spec.name, "': parameter '", param_name,
                 "' is undefined");
    LOOM_REQUIRE(t.is_floating_point(), "FSDP group '", spec.name, "': parameter '", param_name,
                 "' has non-floating dtype ", t.scalar_type(),
                 "; fix: keep integer state in buffers, not parameters");
    LOOM_REQUIRE(t.scalar_type() == dtype, "FSDP group '", spec.name, "' mixes ", dtype, " and ",
                 t.scalar_type(), " parameters ('", param_name,
                 "'); fix: one flat buffer holds one dtype, cast the module first (Module::to)");
    spec.tensors.push_back({param_name, t.sizes().vec(), bytes,
                            options.parameter_granularity
                                ? options.parameter_granularity(param_name, t.sizes())
                                : options.granularity});
  }
  return spec;
}

}  // namespace

FSDPParamGroup::FSDPParamGroup(std::string name, const NamedSlots& params, FSDPMesh mesh,
                               GroupOptions options)
    : name_(std::move(name)),
      mesh_(std::move(mesh)),
      options_(options),
      params_buffer_(plan_group(group_spec(name_, params, options_), mesh_.shard->size(),
                                options_.planner),
                     mesh_.shard->rank(), first_param(name_, params).scalar_type(),
                     options_.param_dtype, options_.device),
      grads_buffer_(params_buffer_.plan(), mesh_.shard->rank(),
                    first_param(name_, params).scalar_type(), options_.reduce_dtype,
                    options_.device) {
  if (options_.post_forward_degree > 1) {
    const int n = options_.post_forward_degree;
    LOOM_REQUIRE(mesh_.post_forward && mesh_.post_forward->size() == n, "FSDP group '", name_,
                 "': reshard_after_forward = ", n, " needs an FSDPMesh with a ", n,
                 "-rank post_forward group; fix: build the mesh with make_fsdp_mesh(mesh, policy)");
    const int64_t chunk = params_buffer_.plan().buffer_elems() / n;
    post_forward_ = ReleasableBuffer(chunk, params_buffer_.unsharded().options());
    post_forward_.release();
  }

  torch::NoGradGuard no_grad;
  // Leaves are created while the unsharded buffer holds memory (aliasing checks bounds).
  params_buffer_.allocate_unsharded();
  for (size_t i = 0; i < params.size(); ++i) {
    Param p;
    p.name = params[i].first;
    p.slot = params[i].second;
    p.index = i;
    p.trainable = p.slot->requires_grad;
    const torch::Tensor& value = p.slot->tensor;
    if (!value.is_meta()) params_buffer_.write_shard_from_full(i, value);
    p.unsharded = params_buffer_.unsharded_alias(i);
    if (p.trainable) p.unsharded.requires_grad_(true);
    p.sharded = params_buffer_.sharded_view(i);
    p.sharded_grad = grads_buffer_.sharded_view(i);
    num_trainable_ += p.trainable;
    params_.push_back(std::move(p));
  }
  params_buffer_.release_unsharded();
  use_sharded_params();
  // A frozen group (LoRA's base) never has a gradient: no gradient shard either (as much memory as
  // its parameter shard otherwise). Its parameters' gradient pieces are empty.
  if (num_trainable_ == 0) {
    grads_buffer_.drop_sharded();
    for (Param& p : params_) p.sharded_grad = grads_buffer_.sharded();
  }

  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].trainable) continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i].unsharded);
    accumulator->add_post_hook(
        std::make_unique<compat::AfterAccumulateGrad>([this, i] { on_grad_accumulated(i); }));
    grad_accumulators_.push_back(std::move(accumulator));
  }
  reset_backward_state();
}

FSDPParamGroup::~FSDPParamGroup() {
  // In-flight collectives write into our buffers: never leave them running behind us.
  try {
    if (gather_work_) gather_work_->wait();
    if (pending_ && pending_->work) pending_->work->wait();
  } catch (...) {
  }
}

void FSDPParamGroup::use_unsharded_params() {
  for (Param& p : params_) p.slot->tensor = p.unsharded;
}

void FSDPParamGroup::use_sharded_params() {
  for (Param& p : params_) p.slot->tensor = p.sharded;
}

void FSDPParamGroup::unshard_async() {
  if (unsharded_ || gather_work_) return;
  // Profiler ranges (profiling/profiler.h) as FSDP2's "FSDP::all_gather": the issue here, the
  // wait and copy-out in wait_for_unshard.
  RECORD_USER_SCOPE("loom::fsdp::all_gather");
  torch::NoGradGuard no_grad;
  params_buffer_.allocate_unsharded();
  const torch::Tensor& out = params_buffer_.unsharded();
  if (post_forward_valid_) {
    // hpZ: the N-rank sub-group together holds the whole buffer.
    gather_work_ = mesh_.post_forward->all_gather_into_tensor_async(out, post_forward_.flat());
    gather_from_post_forward_ = true;
    return;
  }
  torch::Tensor input = params_buffer_.sharded();
  if (input.scalar_type() != options_.param_dtype) {
    // Mixed precision: cast the shard once into this rank's slice of the output and gather in
    // place (the slice is the send buffer). Gloo reads the input before writing any output chunk,
    // so the aliasing is safe there too.
    torch::Tensor slice = params_buffer_.unsharded_rank_slice();
    slice.copy_(input);
    input = slice;
  }
  gather_work_ = mesh_.shard->all_gather_into_tensor_async(out, input);
}

void FSDPParamGroup::wait_for_unshard() {
  if (gather_work_) {
    RECORD_USER_SCOPE("loom::fsdp::all_gather_wait");
    gather_work_->wait();
    gather_work_.reset();
    if (gather_from_post_forward_) {
      post_forward_.release();
      post_forward_valid_ = false;
      gather_from_post_forward_ = false;
    }
    params_buffer_.copy_out_split_tensors();
    unsharded_ = true;
  }
  TORCH_CHECK(unsharded_, "FSDP group '", name_, "': wait_for_unshard without unshard_async");
  use_unsharded_params();
}

void FSDPParamGroup::reshard_after_forward() {
  if (!options_.reshard_after_forward) return;
  if (gather_work_) wait_for_unshard();
  if (!unsharded_) return;
  if (options_.post_forward_degree > 1) {
    torch::NoGradGuard no_grad;
    const int64_t chunk = post_forward_.numel();
    post_forward_.allocate();
    post_forward_.flat().copy_(
        params_buffer_.unsharded().narrow(0, mesh_.post_forward->rank() * chunk, chunk));
    post_forward_valid_ = true;
  }
  params_buffer_.release_unsharded();
  unsharded_ = false;
  use_sharded_params();
}

void FSDPParamGroup::reshard() {
  if (gather_work_) wait_for_unshard();
  if (post_forward_valid_) {
    post_forward_.release();
    post_forward_valid_ = false;
  }
  if (unsharded_) {
    params_buffer_.release_unsharded();
    unsharded_ = false;
  }
  use_sharded_params();
}

void FSDPParamGroup::reset_backward_state() {
  for (Param& p : params_) p.grad_ready = false;
  grads_pending_ = num_trainable_;
  backward_started_ = false;
}

void FSDPParamGroup::prepare_unsharded_grads() {
  if (pending_) {
    if (drain_pending_) drain_pending_();
    if (pending_) advance_reduce(Progress::kWaitAll);
  }
  if (!grads_live_) {
    torch::NoGradGuard no_grad;
    grads_buffer_.allocate_unsharded();
    grads_buffer_.zero_unsharded();
    for (Param& p : params_) {
      if (p.trainable) p.grad_view = grads_buffer_.unsharded_view(p.index);
    }
    grads_live_ = true;
  }
  for (Param& p : params_) {
    if (p.trainable) p.unsharded.mutable_grad() = p.grad_view;
  }
}

void FSDPParamGroup::release_unsharded_grads() {
  for (Param& p : params_) {
    if (!p.trainable) continue;
    p.unsharded.mutable_grad() = torch::Tensor();
    p.grad_view = torch::Tensor();
  }
  grads_buffer_.release_unsharded();
  grads_live_ = false;
}

void FSDPParamGroup::on_grad_accumulated(size_t param_index) {
  Param& p = params_[param_index];
  const torch::Tensor grad = p.unsharded.grad();
  if (!grads_live_ || !grad.defined() ||
      grad.unsafeGetTensorImpl() != p.grad_view.unsafeGetTensorImpl()) {
    // AccumulateGrad ran before this group's pre-backward hook armed the gradient buffer (the
    // module's output hook did not fire): move the gradient it created into the buffer.
    torch::NoGradGuard no_grad;
    prepare_unsharded_grads();
    if (grad.defined()) p.grad_view.add_(grad);
  }
  backward_started_ = true;
  if (p.grad_ready) return;
  p.grad_ready = true;
  if (--grads_pending_ == 0 && on_grads_ready_) on_grads_ready_();
}

void FSDPParamGroup::reduce_grads_async() {
  TORCH_CHECK(!pending_, "FSDP group '", name_, "': reduce issued twice without completing");
  RECORD_USER_SCOPE("loom::fsdp::reduce_scatter");
  if (!grads_live_) prepare_unsharded_grads();  // no gradient arrived: reduce zeros
  torch::NoGradGuard no_grad;
  grads_buffer_.copy_in_split_tensors();
  const torch::Tensor& shard = grads_buffer_.sharded();
  PendingReduce p;
  // The first reduction since zero_grad() lands straight in the gradient shard.
  p.into_sharded_grad = options_.reduce_dtype == shard.scalar_type() && !sharded_grad_valid_;
  p.output = p.into_sharded_grad
                 ? shard
                 : torch::empty({shard.numel()}, grads_buffer_.unsharded().options());
  p.work = mesh_.shard->reduce_scatter_tensor_async(p.output, grads_buffer_.unsharded(),
                                                    distributed::ReduceOp::kSum);
  pending_ = std::move(p);
}

bool FSDPParamGroup::advance_reduce(Progress progress, bool may_issue_all_reduce) {
  if (!pending_) return true;
  PendingReduce& p = *pending_;
  if (!p.reduce_scatter_done) {
    if (progress == Progress::kPoll && !p.work->isCompleted()) return false;
    RECORD_USER_SCOPE("loom::fsdp::reduce_scatter_wait");
    p.work->wait();  // rethrows a failure
    p.work.reset();
    p.reduce_scatter_done = true;
    release_unsharded_grads();  // the reduce-scatter has consumed them
  }
  if (mesh_.replicate_size() > 1) {
    if (!p.all_reduce_issued) {
      if (!may_issue_all_reduce) return false;
      RECORD_USER_SCOPE("loom::fsdp::all_reduce");
      p.work = mesh_.replicate->all_reduce_async(p.output, distributed::ReduceOp::kSum);
      p.all_reduce_issued = true;
    }
    if (progress != Progress::kWaitAll && !p.work->isCompleted()) return false;
    p.work->wait();
    p.work.reset();
  }
  finish_reduce();
  pending_.reset();
  return true;
}

void FSDPParamGroup::finish_reduce() {
  torch::NoGradGuard no_grad;
  PendingReduce& p = *pending_;
  const torch::Tensor& shard = grads_buffer_.sharded();
  const double factor = options_.gradient_divide_factor;
  if (p.into_sharded_grad) {
    if (factor != 1.0) shard.div_(factor);
  } else {
    torch::Tensor reduced = p.output.to(shard.scalar_type());
    if (factor != 1.0) reduced.div_(factor);
    if (sharded_grad_valid_) {
      shard.add_(reduced);
    } else {
      shard.copy_(reduced);
    }
  }
  sharded_grad_valid_ = true;
}

void FSDPParamGroup::zero_grad() {
  TORCH_CHECK(!pending_, "FSDP group '", name_, "': zero_grad with a reduction in flight");
  grads_buffer_.sharded().zero_();
  sharded_grad_valid_ = false;
  if (grads_live_) release_unsharded_grads();
}

std::vector<torch::Tensor> FSDPParamGroup::gather_full_params() {
  torch::NoGradGuard no_grad;
  const torch::Tensor& shard = params_buffer_.sharded();
  torch::Tensor gathered = torch::empty({plan().buffer_elems()}, shard.options());
  mesh_.shard->all_gather_into_tensor(gathered, shard);
  std::vector<torch::Tensor> out;
  out.reserve(params_.size());
  for (const Param& p : params_) {
    out.push_back(params_buffer_.full_from_gathered(p.index, gathered));
  }
  return out;
}

void FSDPParamGroup::load_full_param(size_t param_index, const torch::Tensor& full) {
  TORCH_CHECK(param_index < params_.size(), "parameter index out of range");
  LOOM_REQUIRE(!unsharded_ && !gather_work_ && !post_forward_valid_, "FSDP group '", name_,
               "': loading parameter '", params_[param_index].name,
               "' while unsharded would leave a stale copy; fix: reshard() first");
  params_buffer_.write_shard_from_full(params_[param_index].index, full);
}

int64_t FSDPParamGroup::unsharded_bytes_allocated() const {
  int64_t bytes = 0;
  if (params_buffer_.unsharded_allocated()) {
    bytes += params_buffer_.allocated_bytes() - static_cast<int64_t>(sharded_params().nbytes());
  }
  if (grads_buffer_.unsharded_allocated()) {
    bytes += grads_buffer_.allocated_bytes() - static_cast<int64_t>(sharded_grads().nbytes());
  }
  if (post_forward_valid_) bytes += post_forward_.capacity_bytes();
  return bytes;
}

int64_t FSDPParamGroup::sharded_bytes() const {
  return static_cast<int64_t>(sharded_params().nbytes() + sharded_grads().nbytes());
}

}  // namespace loom::fsdp
