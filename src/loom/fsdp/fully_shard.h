// fully_shard: Loom's FSDP, applied from outside the model like PyTorch FSDP2's fully_shard, with
// veScale-FSDP's flat, planner-laid-out buffers underneath (one DistributedBuffer per group, see
// distributed_buffer.h and param_group.h).
//
// Usage (TorchTitan's apply_fsdp, see models/common/parallelize.h):
//   FSDPMesh mesh = make_fsdp_mesh(device_mesh, policy);
//   for (block : model.layers) fully_shard(block, mesh, policy);
//   auto fsdp = fully_shard(model, mesh, policy);   // the root: owns what the blocks do not
//   ... forward / backward as usual ...
//   fsdp->finalize_backward();   // waits for the reduce-scatters (the optimizer calls it too)
//
// Each fully_shard call makes one group out of the module's parameters not owned by an
// already-sharded descendant. Its forward pre-hook all-gathers the group (and prefetches the next
// group's all-gather), its forward post-hook frees the unsharded parameters (ZeRO-3), keeps them
// (ZeRO-2) or keeps a 1/N shard (hpZ) and registers a hook on the output's gradient that
// re-gathers the group before its backward (prefetching the group whose backward comes next).
// Gradients accumulate straight into the flat unsharded gradient buffer; when the group's last
// gradient has arrived its reduce-scatter is issued asynchronously and overlaps the backward of
// the groups before it. The outermost FSDP module is the root: its parameters stay unsharded from
// forward to backward (they are needed first), it casts the output to fp32 under mixed precision,
// and at the end of backward it issues anything still outstanding.
//
// Several modules can share one group (FSDP2's fully_shard([m1, m2])): apply_fsdp's buckets of
// consecutive blocks and the head (final norm + output). The group is gathered when the first of
// them starts its forward, resharded when the last has finished, and reduce-scattered when the last
// of their gradients has arrived. Each group's pre-forward (pre-backward) issues the all-gathers of
// the next policy.prefetch_depth groups in forward (backward) order.
//
// Model code must run forward through the modules' forward() (call_with_hooks), or, where it reads
// a module's parameters directly, between its hooks (nn::Module::run_between_hooks); anything else
// bypasses the hooks: use unshard()/reshard() explicitly then.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "loom/distributed/device_mesh.h"
#include "loom/fsdp/param_group.h"
#include "loom/fsdp/planner.h"
#include "loom/nn/module.h"
#include "loom/optim/optimizer.h"

namespace loom::fsdp {

// What happens to a group's parameters after its forward:
//   always()       free them; backward all-gathers again over the W shard ranks (ZeRO-3);
//   never()        keep them unsharded until after backward (ZeRO-2);
//   degree(N)      keep a 1/N shard, so backward all-gathers over N ranks only (hpZ); N must
//                  divide W (N = W is always(), N = 1 is never()).
class ReshardAfterForward {
 public:
  static ReshardAfterForward always() { return ReshardAfterForward(-1); }
  static ReshardAfterForward never() { return ReshardAfterForward(0); }
  static ReshardAfterForward degree(int n);
  // "true" | "false" | "always" | "never" | an integer N >= 1.
  static ReshardAfterForward parse(const std::string& text);

  bool is_degree() const { return value_ > 0; }
  int degree() const { return value_; }
  std::string str() const;
  friend bool operator==(const ReshardAfterForward&, const ReshardAfterForward&) = default;

 private:
  explicit ReshardAfterForward(int value) : value_(value) {}
  int value_;  // -1 always, 0 never, N > 0 degree
};

struct MixedPrecisionPolicy {
  // All-gathered parameters and the forward/backward compute use param_dtype; gradients are
  // accumulated and reduced in reduce_dtype. The shards (and the optimizer) keep the parameters'
  // own dtype.
  c10::ScalarType param_dtype = torch::kFloat32;
  c10::ScalarType reduce_dtype = torch::kFloat32;
  // The root casts floating-point outputs back to float32.
  bool cast_root_output = true;
};

struct FSDPPolicy {
  // Mesh dims (real or flattened) to shard over and, for HSDP, to replicate over. A dim absent
  // from the mesh has size 1 when it is one ParallelDims drops at degree 1 (dp_shard,
  // dp_shard_cp, dp_replicate); any other absent name is an error.
  std::string shard_dim = "dp_shard";
  std::string replicate_dim = "dp_replicate";
  // The unit the planner must not cut across ranks (element, row, k-row block, whole).
  tensor::Granularity granularity = tensor::Granularity::element();
  // Per-parameter granularity by name and full shape, overriding `granularity` where set: a
  // block-wise quantized optimizer asks for its block here (fsdp::adamw8bit_granularity) so that no
  // quantization block is cut across ranks, Muon for whole matrices (fsdp::muon_granularity).
  ParameterGranularity parameter_granularity;
  PlannerOptions planner;
  ReshardAfterForward reshard_after_forward = ReshardAfterForward::always();
  MixedPrecisionPolicy mixed_precision;
  // Gradients are summed over all data-parallel ranks and divided by this; default: their number
  // (shard x replicate size), i.e. the mean, as DDP and FSDP2 do.
  std::optional<double> gradient_divide_factor;
  // Issue the next groups' all-gathers when a group starts its forward / backward (from the second
  // forward on: the order is recorded during the first).
  bool forward_prefetch = true;
  bool backward_prefetch = true;
  // How many groups ahead those prefetches reach: the all-gathers of the next prefetch_depth groups
  // (in forward order, and in backward order) are in flight while a group computes. 1 = the next
  // group only (FSDP2's); more hides a gather that takes longer than one group's compute, at the
  // cost of up to prefetch_depth + 1 groups held gathered at once. 0 = no prefetch.
  int prefetch_depth = 1;
  // The rank's device (training.device): the flat buffers, gradients and the optimizer state live
  // there, and the collectives run on it (NCCL on CUDA, see distributed/comm.h).
  c10::Device device = c10::Device(c10::kCPU);
};

// The FSDP communication groups of `mesh` for `policy`; creates the hpZ sub-groups when the policy
// asks for reshard_after_forward = N (every rank must call it, in the same order relative to other
// group creation). Throws loom::UsageError for a dim the mesh lacks, for shard and replicate groups
// that overlap (the mesh does not match the data-parallel degrees), or for an N not dividing the
// shard size.
FSDPMesh make_fsdp_mesh(const distributed::DeviceMesh& mesh, const FSDPPolicy& policy);

// One tensor of a sharded state dict: this rank's contiguous run of a tensor's row-major
// elements, with what a checkpoint needs to place it.
struct ShardedTensor {
  std::string name;                   // e.g. "layers.0.attention.wq.weight" or "...exp_avg"
  torch::Tensor local;                // a view into the shard (empty when this rank holds none)
  std::vector<int64_t> global_shape;  // the full tensor's shape
  // Row-major flat index in the full tensor of local's first element.
  int64_t global_offset = 0;
  bool trainable = true;  // false: a frozen parameter (LoRA's base)
};

class FSDPModule : public std::enable_shared_from_this<FSDPModule> {
 public:
  ~FSDPModule();
  FSDPModule(const FSDPModule&) = delete;
  FSDPModule& operator=(const FSDPModule&) = delete;

  // The (first) module sharded; modules(): all of them, for a group of several.
  nn::Module& module() const { return *members_.front().module; }
  std::vector<nn::Module*> modules() const;
  // Dotted path of the module from the outermost FSDP module ("" for it). For a group of several
  // modules: the path of the module their given paths are relative to (the parameter names carry
  // the rest).
  const std::string& fqn() const { return fqn_; }
  // No FSDP module above this one.
  bool is_root() const { return root_.expired(); }
  // Null when every parameter of the module belongs to a descendant's group.
  FSDPParamGroup* param_group() const { return group_.get(); }
  // This module then every FSDP module below it, in module order.
  std::vector<std::shared_ptr<FSDPModule>> states();
  // The groups of states() that have parameters.
  std::vector<FSDPParamGroup*> param_groups();
  const FSDPPolicy& policy() const { return policy_; }
  const FSDPMesh& mesh() const { return mesh_; }
  // Fully qualified parameter name (from the outermost FSDP module) of `p` of `group`.
  std::string param_fqn(const FSDPParamGroup& group, const FSDPParamGroup::Param& p);

  // ---- Explicit control (whole subtree) ----
  // All-gathers every group (all issued before any is waited for) and keeps them unsharded until
  // reshard() or the next post-forward / post-backward reshard.
  void unshard();
  // Issues every group's all-gather and returns; each group's forward (or backward) hook waits for
  // its own (a pipeline's UNSHARD action, overlapping the gathers with the compute before it).
  void unshard_async();
  void reshard();
  // Off: the forward leaves the parameters unsharded (no free after a forward); a pipeline stage
  // holds them from its UNSHARD to its RESHARD action across micro-batches, and the zero-bubble
  // split's weight gradients (W, after the forward and backward of later micro-batches) find them
  // there (FSDP2's set_reshard_after_forward). On by default (the policy's reshard_after_forward).
  void set_reshard_after_forward(bool enabled);
  // Off: backward accumulates the unsharded gradients locally and issues no reduce-scatter
  // (gradient accumulation without resync; the micro-batch with sync on reduces the sum).
  void set_requires_gradient_sync(bool enabled);
  bool requires_gradient_sync() const;
  // Off: backward leaves the parameters unsharded (no free, so no re-gather in the next forward);
  // a pipeline stage under reshard_after_forward = never keeps them gathered across its
  // micro-batches and reshards with its last backward of the step (FSDP2's
  // set_reshard_after_backward). On by default.
  void set_reshard_after_backward(bool enabled);

  // The schedule's REDUCE_GRAD: issues the reduce-scatter (and, HSDP, then the all-reduce) of every
  // trainable group's gradients accumulated since the last reduction, in reverse module order (a
  // backward's), asynchronously; finalize_backward waits for them. Groups whose backward is still
  // marked open (an I/W split leaves the hooks' bookkeeping so) are closed first without reducing.
  // Meant with requires_gradient_sync off, so the hooks never reduce on their own.
  void reduce_gradients();
  // Makes `roots` (several FSDP roots on this rank: a pipeline rank's stages) keep one queue of
  // in-flight reductions, so the HSDP all-reduces that follow their reduce-scatters are issued in
  // the same order on every rank whatever the timing (each root alone keeps its own order only).
  static void share_reductions(const std::vector<std::shared_ptr<FSDPModule>>& roots);

  // ---- Training step ----
  // Completes the backward of groups it did not finish (unused parameters), waits for every
  // outstanding reduce-scatter (and HSDP all-reduce) and leaves every group resharded. Called by
  // the sharded optimizer, zero_grad and clip_grad_norm_ too; cheap when nothing is outstanding.
  void finalize_backward();
  // Zeroes the gradient shards and drops unsharded gradients still accumulating.
  void zero_grad();
  // Global 2-norm of the gradients (shards summed over the shard group; HSDP replicas hold
  // identical shards and are not counted twice), then scales them by min(1, max_norm / norm).
  // Returns the norm before clipping.
  torch::Tensor clip_grad_norm_(double max_norm);
  // Same norm without clipping.
  torch::Tensor grad_norm();

  // ---- Values ----
  // Every parameter's full value (the shards' dtype, normally fp32) by fully qualified name.
  // Collective: every rank of the shard group must call it.
  optim::TensorDict full_state_dict();
  // Writes this rank's piece of every parameter named in `full` (fully qualified names; every
  // parameter must be present). No communication.
  // Fills every parameter from `full` (whole tensors by name); `optional`: parameters `full` may
  // lack, which keep their values (a LoRA adapter when `full` is the base).
  void load_full_state_dict(const optim::TensorDict& full, const std::set<std::string>& optional = {});
  // Draws each parameter's full value with `fill(fqn, full)` (a CPU fp32 tensor of its shape, one
  // at a time) and keeps this rank's piece: initialization without materializing the model.
  void init_parameters(
      const std::function<void(const std::string& fqn, torch::Tensor& full)>& fill);
  // This rank's piece of every parameter, with offsets.
  std::vector<ShardedTensor> sharded_state_dict();

  // All-gathers issued ahead of need by forward / backward prefetching, across the root's whole
  // tree, since the last reset: what overlaps communication with compute.
  struct PrefetchCounts {
    int64_t forward = 0;
    int64_t backward = 0;
  };
  PrefetchCounts prefetch_counts();
  void reset_prefetch_counts();

  // ---- Memory (this rank) ----
  int64_t sharded_bytes();              // parameter + gradient shards
  int64_t unsharded_bytes_allocated();  // unsharded buffers held right now

 private:
  friend std::shared_ptr<FSDPModule> fully_shard(const std::vector<std::pair<std::string, nn::Module*>>&,
                                                 const FSDPMesh&, const FSDPPolicy&, const std::string&);
  struct RootContext;
  // One module of the group, with its path relative to the group's fqn (the prefix of its
  // parameters' names in the group; "" for a lone module).
  struct Member {
    nn::Module* module = nullptr;
    std::string path;
    nn::HookHandle pre_hook;
    nn::HookHandle post_hook;
    bool ran = false;  // its forward has run since the group's forward began
  };

  FSDPModule(std::vector<Member> members, FSDPMesh mesh, FSDPPolicy policy);
  void attach(std::vector<std::pair<std::string, std::shared_ptr<FSDPModule>>> descendants);
  std::shared_ptr<FSDPModule> root();
  RootContext& context();

  // The hooks of member `member`; the group's own pre-forward runs with the first member to start
  // (group_pre_forward), its post-forward with the last to finish (group_post_forward).
  torch::Tensor pre_forward(size_t member, torch::Tensor input);
  torch::Tensor post_forward(size_t member, torch::Tensor output);
  torch::Tensor group_pre_forward(torch::Tensor input);
  torch::Tensor group_post_forward(torch::Tensor output);
  void pre_backward();
  void post_backward();
  void root_pre_forward();
  void root_post_backward_callback();
  // Runs the post-backward of groups whose backward did not finish and reshards every group of
  // the root's tree.
  void complete_backward();
  void drain_reduces(FSDPParamGroup* through, FSDPParamGroup::Progress progress);
  // Issues `target`'s all-gather ahead of need; true when one was issued.
  static bool prefetch(FSDPParamGroup& target);
  // Issues the all-gathers of the first `depth` groups after this state in [begin, end) (an order
  // of states: the forward's, or the backward's as reverse iterators); returns how many it issued.
  template <typename It>
  int64_t prefetch_after(It begin, It end, int depth) const;
  void poll_reduces();

  std::vector<Member> members_;
  FSDPMesh mesh_;
  FSDPPolicy policy_;
  std::string fqn_;
  std::unique_ptr<FSDPParamGroup> group_;
  std::weak_ptr<FSDPModule> root_;  // the outermost FSDP module above, unless this is it
  // Every FSDP module below (with paths relative to this module), in module order.
  std::vector<std::pair<std::string, std::shared_ptr<FSDPModule>>> descendants_;
  std::unique_ptr<RootContext> context_;  // runtime state of the root's forward/backward
  bool requires_gradient_sync_ = true;
  bool reshard_after_forward_ = true;
  bool reshard_after_backward_ = true;
  bool in_backward_ = false;  // pre-backward ran, post-backward not yet
  bool forward_open_ = false;  // a member's forward began and not every member's has finished
};

// The FSDP roots of one rank stepped as one: the model's root, or each pipeline stage's (every
// stage on a rank is its own root, as in PyTorch's pipelining with FSDP2). What the sharded
// optimizers and the parameter storage iterate: every group of every root, in root order.
class FSDPRoots {
 public:
  FSDPRoots() = default;
  FSDPRoots(std::shared_ptr<FSDPModule> root);  // NOLINT: one root converts implicitly
  explicit FSDPRoots(std::vector<std::shared_ptr<FSDPModule>> roots);

  const std::vector<std::shared_ptr<FSDPModule>>& roots() const { return roots_; }
  bool empty() const { return roots_.empty(); }
  FSDPModule& front() const { return *roots_.front(); }
  std::vector<FSDPParamGroup*> param_groups() const;
  // The fully qualified name of `p` of `group`, from whichever root holds the group.
  std::string param_fqn(const FSDPParamGroup& group, const FSDPParamGroup::Param& p) const;
  void finalize_backward() const;
  void zero_grad() const;
  std::vector<ShardedTensor> sharded_state_dict() const;

 private:
  std::vector<std::shared_ptr<FSDPModule>> roots_;
};

// Shards `module`'s parameters not already owned by an FSDP descendant (shard those first) and
// hooks its forward. Returns the handle; the module's hooks keep it alive, so dropping it is fine.
// `name` labels the group in plans and errors (default: the module's type name). Throws
// loom::Error / UsageError for a module sharded twice, parameters of different dtypes, a
// granularity that does not divide a parameter, or a policy the mesh cannot serve.
std::shared_ptr<FSDPModule> fully_shard(nn::Module& module, const FSDPMesh& mesh,
                                        const FSDPPolicy& policy = {},
                                        const std::string& name = "");

// FSDP2's fully_shard([m1, m2, ...]): one group of the parameters of several modules (none inside
// another), so one all-gather and one reduce-scatter serve them all. The group is gathered when the
// first of them starts its forward and (per the policy) resharded when the last has finished; its
// reduce-scatter is issued once all of their gradients have arrived. Each module comes with its
// path relative to one common ancestor (usually the model: {"layers.0", &block0}), which prefixes
// its parameters' names, so the fully qualified names are those the modules would have if sharded
// one by one and a checkpoint does not see the grouping. `name` defaults to the paths joined by
// "+". Throws loom::Error as above, and for an empty list, a repeated module or path, or a module
// inside another of the list.
std::shared_ptr<FSDPModule> fully_shard(const std::vector<std::pair<std::string, nn::Module*>>& modules,
                                        const FSDPMesh& mesh, const FSDPPolicy& policy = {},
                                        const std::string& name = "");

// Buckets of consecutive units (apply_fsdp's blocks) holding `bytes[i]` bytes each, of about
// `target_bytes` each: a unit joins the open bucket while that leaves the bucket nearer the target
// than closing it would (the bucket may overshoot by less than it would otherwise fall short), so a
// unit at or over the target is a bucket of its own. target_bytes <= 0: one bucket per unit.
// Returns each bucket's [begin, end) unit indices, in order, covering every unit.
std::vector<std::pair<size_t, size_t>> plan_buckets(const std::vector<int64_t>& bytes, int64_t target_bytes);

// The FSDP handle of `module`, or null when it was not fully_shard-ed.
std::shared_ptr<FSDPModule> fsdp_state(const nn::Module& module);

}  // namespace loom::fsdp
