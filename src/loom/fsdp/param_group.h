// One FSDP group: the parameters of one fully_shard-ed module (those not owned by a child group),
// their DistributedBuffers, and the collectives that move them:
//   unshard      all-gather the parameter shards into the unsharded buffer (in place; hpZ: from
//                the post-forward shard over the N-rank sub-group), then point the module's
//                parameter slots at the unsharded leaves;
//   reshard      release the unsharded buffer (optionally keeping a 1/N post-forward shard) and
//                point the slots back at the sharded views;
//   reduce       reduce-scatter the flat unsharded gradient buffer into the gradient shard (HSDP:
//                then all-reduce the shard over the replicas), divide, accumulate.
// The hooks deciding *when* these run live in fully_shard.cpp.
//
// Parameters the forward uses are persistent leaf tensors ("unsharded leaves"), one per parameter,
// kept across steps so autograd's grad accumulators and their hooks are created once. They alias
// the unsharded buffer (ReleasableBuffer::alias), their .grad is a view into the unsharded gradient
// buffer, and AccumulateGrad adds into it in place: no per-parameter copy in or out.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/torch_compat.h"
#include "loom/distributed/comm.h"
#include "loom/fsdp/distributed_buffer.h"
#include "loom/fsdp/planner.h"
#include "loom/nn/module.h"

namespace torch::autograd {
struct Node;
}

namespace loom::fsdp {

// The communication groups of an FSDP group.
struct FSDPMesh {
  std::shared_ptr<distributed::Comm> shard;      // parameters are sharded over these W ranks (dp_shard)
  std::shared_ptr<distributed::Comm> replicate;  // HSDP replicas (dp_replicate); a 1-rank comm when none
  // hpZ (reshard_after_forward = N, 1 < N < W): the N consecutive ranks of `shard` this rank
  // belongs to; the backward all-gather runs over it. Null otherwise.
  std::shared_ptr<distributed::Comm> post_forward;

  int shard_size() const { return shard->size(); }
  int replicate_size() const { return replicate ? replicate->size() : 1; }
  // A one-process mesh (world rank `world_rank`): no network.
  static FSDPMesh single(int world_rank = 0);
};

// A parameter's granularity from its name (relative to the group's module, e.g.
// "attention.wq.weight") and full shape (see FSDPPolicy::parameter_granularity); unset means the
// group's one granularity for every parameter.
using ParameterGranularity =
    std::function<tensor::Granularity(std::string_view name, c10::IntArrayRef shape)>;

// Everything a group needs from the policy, resolved (see FSDPPolicy in fully_shard.h).
struct GroupOptions {
  tensor::Granularity granularity = tensor::Granularity::element();
  ParameterGranularity parameter_granularity;
  PlannerOptions planner;
  c10::ScalarType param_dtype = c10::ScalarType::Float;   // all-gather and compute
  c10::ScalarType reduce_dtype = c10::ScalarType::Float;  // gradient accumulation and reduction
  bool reshard_after_forward = true;
  // hpZ: keep a 1/post_forward_degree shard after forward (needs FSDPMesh::post_forward).
  int post_forward_degree = 0;
  double gradient_divide_factor = 1.0;
  // Where the group's flat buffers (parameter and gradient shards, unsharded buffers) live: the
  // rank's device. Parameters materialized elsewhere are copied in; the optimizer state follows.
  c10::Device device = c10::Device(c10::kCPU);
};

class FSDPParamGroup {
 public:
  struct Param {
    std::string name;  // relative to the group's module, e.g. "attention.wq.weight"
    nn::ParameterSlot* slot = nullptr;
    size_t index = 0;  // in the plan
    bool trainable = true;
    torch::Tensor unsharded;     // the persistent leaf (param_dtype)
    torch::Tensor sharded;       // view of the parameter shard (the original dtype)
    torch::Tensor sharded_grad;  // view of the gradient shard
    torch::Tensor grad_view;     // the leaf's .grad while the unsharded gradients are live
    bool grad_ready = false;     // this backward's gradient has been accumulated
  };

  // `params`: (name relative to the module, slot), in module order. Values already materialized
  // are copied into the shard (on options.device); parameters on the meta device leave zeros (load
  // values later).
  // Afterwards every slot holds its sharded view.
  FSDPParamGroup(std::string name,
                 const std::vector<std::pair<std::string, nn::ParameterSlot*>>& params,
                 FSDPMesh mesh, GroupOptions options);
  ~FSDPParamGroup();
  FSDPParamGroup(const FSDPParamGroup&) = delete;
  FSDPParamGroup& operator=(const FSDPParamGroup&) = delete;

  const std::string& name() const { return name_; }
  const Plan& plan() const { return params_buffer_.plan(); }
  const FSDPMesh& mesh() const { return mesh_; }
  const GroupOptions& options() const { return options_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  DistributedBuffer& params_buffer() { return params_buffer_; }
  const DistributedBuffer& params_buffer() const { return params_buffer_; }
  DistributedBuffer& grads_buffer() { return grads_buffer_; }
  const DistributedBuffer& grads_buffer() const { return grads_buffer_; }
  // The parameter and gradient shards (S elements each) the optimizer updates.
  const torch::Tensor& sharded_params() const { return params_buffer_.sharded(); }
  const torch::Tensor& sharded_grads() const { return grads_buffer_.sharded(); }

  // ---- Parameters ----
  bool is_unsharded() const { return unsharded_; }
  bool is_gathering() const { return gather_work_ != nullptr; }
  bool has_post_forward_shard() const { return post_forward_valid_; }
  // Issues the all-gather (no-op when unsharded or already gathering).
  void unshard_async();
  // Completes a pending all-gather and points the module's slots at the unsharded leaves.
  void wait_for_unshard();
  void unshard() { unshard_async(); wait_for_unshard(); }
  // After forward: keep the 1/N post-forward shard (hpZ) or nothing, release the unsharded buffer.
  void reshard_after_forward();
  // Releases the unsharded buffer (and any post-forward shard); slots point at the sharded views.
  void reshard();

  // ---- Gradients ----
  // Allocates and zeroes the unsharded gradient buffer unless live, and sets every trainable
  // leaf's .grad to its view. Waits for this group's pending reduction first (its input).
  void prepare_unsharded_grads();
  bool unsharded_grads_live() const { return grads_live_; }
  // Fired (from the post-accumulate-grad hooks) once every trainable parameter has its gradient
  // for this backward.
  void set_on_grads_ready(std::function<void()> callback) { on_grads_ready_ = std::move(callback); }
  // Called before the gradient buffer is re-armed while this group still has a reduction in
  // flight: must complete it, keeping the cross-rank order of HSDP all-reduces (the owner drains
  // its queue up to this group). Without it the group waits on its own.
  void set_drain_pending(std::function<void()> callback) { drain_pending_ = std::move(callback); }
  void reset_backward_state();
  bool backward_started() const { return backward_started_; }
  // Whether any parameter of the group is trainable; a frozen group (LoRA's base) gathers for
  // forward and backward but has no gradients to reduce.
  bool has_trainable() const { return num_trainable_ > 0; }
  void mark_backward_started() { backward_started_ = true; }
  // Issues the reduce-scatter of the unsharded gradients into the shard (async).
  void reduce_grads_async();
  enum class Progress { kPoll, kWaitReduceScatter, kWaitAll };
  // Advances the pending reduction: kPoll never blocks; kWaitReduceScatter blocks until the
  // reduce-scatter is done (and issues the HSDP all-reduce when `may_issue_all_reduce`);
  // kWaitAll finishes it. Returns true when nothing is pending any more. HSDP all-reduces must be
  // issued in the same order on every rank: the caller passes may_issue_all_reduce = false for
  // every group queued behind one whose all-reduce is not issued yet.
  bool advance_reduce(Progress progress, bool may_issue_all_reduce = true);
  bool has_pending_reduce() const { return pending_.has_value(); }
  bool pending_all_reduce_issued() const { return pending_ && pending_->all_reduce_issued; }
  // Zeroes the gradient shard and drops accumulated unsharded gradients.
  void zero_grad();
  // Whether the gradient shard holds a reduction since the last zero_grad().
  bool has_sharded_grads() const { return sharded_grad_valid_; }

  // ---- Values ----
  // Every parameter's full value in the shard dtype (all-gather of the shards over `shard`).
  std::vector<torch::Tensor> gather_full_params();
  void load_full_param(size_t param_index, const torch::Tensor& full);

  // Unsharded bytes held now (parameters, gradients, post-forward shard).
  int64_t unsharded_bytes_allocated() const;
  int64_t sharded_bytes() const;

 private:
  void use_unsharded_params();
  void use_sharded_params();
  void release_unsharded_grads();
  void on_grad_accumulated(size_t param_index);
  void finish_reduce();

  struct PendingReduce {
    distributed::WorkHandle work;
    torch::Tensor output;  // S elements of reduce_dtype
    bool into_sharded_grad = false;
    bool reduce_scatter_done = false;
    bool all_reduce_issued = false;
  };

  std::string name_;
  FSDPMesh mesh_;
  GroupOptions options_;
  DistributedBuffer params_buffer_;
  DistributedBuffer grads_buffer_;
  ReleasableBuffer post_forward_;  // hpZ: this rank's 1/N of the unsharded buffer
  std::vector<Param> params_;
  int num_trainable_ = 0;

  bool unsharded_ = false;
  distributed::WorkHandle gather_work_;
  bool gather_from_post_forward_ = false;
  bool post_forward_valid_ = false;

  bool grads_live_ = false;
  bool sharded_grad_valid_ = false;
  int grads_pending_ = 0;
  bool backward_started_ = false;
  std::optional<PendingReduce> pending_;
  std::function<void()> on_grads_ready_;
  std::function<void()> drain_pending_;
  std::vector<compat::GradAccumulatorPtr> grad_accumulators_;
};

}  // namespace loom::fsdp
