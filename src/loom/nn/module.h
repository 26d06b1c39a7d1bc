// Loom's module base class: a tree of modules owning named parameter and buffer slots.
//
// Why not torch::nn::Module: FSDP (and later TP/PP) must swap a parameter for a view into a flat
// buffer, and hook every forward of a block, without the model code knowing. Here every parameter
// lives in a heap-allocated ParameterSlot whose address never changes; layers read their weights
// through the slot on each forward, so replacing `slot->tensor` (or calling set_parameter) is all a
// parallelism wrapper needs. Forward pre/post hooks run around the forward of any module that routes
// its main input through call_with_hooks (every layer in loom::nn does).
//
// Parameters may be created on the meta device (no memory) and materialized later with to_empty()
// followed by a per-parameter initializer; see loom/nn/init.h.
#pragma once
#include <torch/torch.h>

#include "loom/tensor/placement.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace loom::nn {

class Module;

// One named parameter of a module. `tensor` is what forward uses; replace it to re-point the module
// (e.g. to a view into a flat buffer). `requires_grad` is the parameter's declared trainability and
// is re-applied by set_parameter / to / to_empty to leaf tensors.
struct ParameterSlot {
  std::string name;  // local name inside `owner`, e.g. "weight"
  torch::Tensor tensor;
  bool requires_grad = true;
  Module* owner = nullptr;
  // Where the tensor's pieces live when a parallelism applied from outside shards it (TP's
  // Shard(d) on "tp"): its global shape and this rank's box, which checkpoints, initial loads and
  // the gradient norm read. Unset: this rank holds the whole tensor (FSDP's flat shards are its
  // storage's business, parallel/parameter_storage.h).
  std::optional<tensor::TensorLayout> layout;
};

struct BufferSlot {
  std::string name;
  torch::Tensor tensor;
  bool persistent = true;  // part of state_dict(); non-persistent buffers are recomputable caches
  Module* owner = nullptr;
};

// A slot reached from some root module, with its dotted path from that root
// (e.g. "layers.0.attention.wq.weight"). The pointer stays valid while the owning module lives.
struct NamedParameter {
  std::string name;
  ParameterSlot* slot;
  const torch::Tensor& tensor() const { return slot->tensor; }
};

struct NamedBuffer {
  std::string name;
  BufferSlot* slot;
  const torch::Tensor& tensor() const { return slot->tensor; }
};

// Pre-hook: receives the module and its input, returns the input to use (return it unchanged to
// only observe). Post-hook: receives module, input and output, returns the output to use.
using ForwardPreHook = std::function<torch::Tensor(Module&, torch::Tensor input)>;
using ForwardPostHook =
    std::function<torch::Tensor(Module&, torch::Tensor input, torch::Tensor output)>;
// Around-hook: runs instead of the module's forward (after the pre-hooks, before the post-hooks)
// and may call `forward`, the module's own, or not. What PyTorch users do by reassigning
// `module.forward`: a parallelism that fuses a module's computation with communication (async
// tensor parallel's collective matmuls) replaces the computation without the model knowing.
// `forward` is only valid during the call unless the module says otherwise: a module whose
// forward captures its per-call arguments by value (llama3's TransformerBlock) lets an around-hook
// keep a copy and run it again later (activation checkpointing re-runs it in backward).
using ForwardFn = std::function<torch::Tensor(const torch::Tensor&)>;
using ForwardOverride =
    std::function<torch::Tensor(Module&, const torch::Tensor& input, const ForwardFn& forward)>;

// What a pre- or post-hook does to the values passing through. kTransform: it may change them (a
// parallel style's collectives, a cast), so code that uses the module's parameters without calling
// its forward must not skip it. kStateOnly: it returns its input or output unchanged and only
// manages state around the call (FSDP gathering the parameters before and freeing them after), so
// such code may run between the hooks instead (Module::run_between_hooks).
enum class HookKind { kTransform, kStateOnly };

namespace detail {
struct HookTable {
  int64_t next_id = 0;
  std::map<int64_t, ForwardPreHook> pre;  // ordered by id = registration order
  std::map<int64_t, ForwardPostHook> post;
  std::set<int64_t> state_only;  // ids of the pre/post hooks of HookKind::kStateOnly
  ForwardOverride around;  // at most one
};
}  // namespace detail

// Removes a hook. Dropping the handle keeps the hook registered; remove() is idempotent and safe
// after the module is gone.
class HookHandle {
 public:
  HookHandle() = default;
  HookHandle(std::weak_ptr<detail::HookTable> table, int64_t id, bool is_pre)
      : table_(std::move(table)), id_(id), is_pre_(is_pre) {}
  void remove();

 private:
  std::weak_ptr<detail::HookTable> table_;
  int64_t id_ = -1;
  bool is_pre_ = true;
};

class Module {
 public:
  explicit Module(std::string type_name);
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The C++ class name for printing ("Linear", "TransformerBlock", ...).
  const std::string& type_name() const { return type_name_; }

  // ---- Registration (called from constructors; names must be unique and dot-free) ----
  // Returns the slot, whose address is stable for the module's lifetime.
  ParameterSlot* register_parameter(const std::string& name, torch::Tensor tensor,
                                    bool requires_grad = true);
  BufferSlot* register_buffer(const std::string& name, torch::Tensor tensor,
                              bool persistent = true);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }
  // Detaches a child (e.g. a pipeline stage dropping layers it does not own). Returns it.
  std::shared_ptr<Module> remove_module(const std::string& name);

  // ---- Traversal (pre-order: own slots first, then children in registration order) ----
  std::vector<NamedParameter> named_parameters(bool recurse = true);
  std::vector<NamedBuffer> named_buffers(bool recurse = true);
  // This module first (name ""), then every descendant with its dotted path.
  std::vector<std::pair<std::string, Module*>> named_modules();
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;
  std::vector<torch::Tensor> parameters(bool recurse = true);
  int64_t num_parameters(bool recurse = true);

  // Dotted-path lookups; throw loom::Error naming the missing path.
  Module& submodule(const std::string& path);
  Module* find_submodule(const std::string& path);  // nullptr when absent
  ParameterSlot& parameter_slot(const std::string& path);
  BufferSlot& buffer_slot(const std::string& path);
  const torch::Tensor& parameter(const std::string& path) { return parameter_slot(path).tensor; }
  const torch::Tensor& buffer(const std::string& path) { return buffer_slot(path).tensor; }

  // Replaces the tensor of a parameter slot (shape may differ: FSDP installs shards). A leaf tensor
  // gets the slot's requires_grad flag; a non-leaf (the output of an autograd op) is stored as is.
  void set_parameter(const std::string& path, torch::Tensor tensor);
  void set_buffer(const std::string& path, torch::Tensor tensor);

  // Parameters then persistent buffers, detached, with dotted names: what a checkpoint stores.
  std::vector<std::pair<std::string, torch::Tensor>> state_dict();

  // ---- Conversion (whole subtree; floating-point tensors only for dtype) ----
  void to(c10::ScalarType dtype);
  void to(c10::Device device);
  // Replaces every parameter and buffer by uninitialized storage of the same shape and dtype on
  // `device`: the step after building on the meta device. Values must then be initialized.
  void to_empty(c10::Device device);

  // set_to_none drops the gradient tensors (the default, like PyTorch); otherwise zeroes them.
  void zero_grad(bool set_to_none = true);

  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // ---- Hooks ----
  HookHandle add_forward_pre_hook(ForwardPreHook hook, HookKind kind = HookKind::kTransform);
  HookHandle add_forward_post_hook(ForwardPostHook hook, HookKind kind = HookKind::kTransform);
  // Replaces the forward (see ForwardOverride); a second call replaces the first, null removes it.
  void set_forward_override(ForwardOverride around);
  // The installed override (null when none), so a second wrapper can chain to the first.
  const ForwardOverride& forward_override() const { return hooks_->around; }
  bool has_forward_hooks() const {
    return !hooks_->pre.empty() || !hooks_->post.empty() || hooks_->around != nullptr;
  }
  // Whether a hook may change what the forward computes: an around-hook, or a pre/post hook of
  // HookKind::kTransform. False when every hook is kStateOnly (or there is none).
  bool has_transforming_hooks() const {
    return hooks_->around != nullptr ||
           hooks_->pre.size() + hooks_->post.size() != hooks_->state_only.size();
  }
  // Runs `use` on `input` between the module's pre- and post-hooks, in place of its forward: for
  // code that reads the module's parameters directly rather than through forward() (a head fused
  // with its loss reads output.weight), so hooks that manage the parameters see the use (FSDP
  // gathers them before and registers its backward hook on the result after). Read the
  // parameters inside `use`: a pre-hook may have replaced them. Throws loom::Error when a hook may
  // transform values (has_transforming_hooks): then the module must run its own forward.
  torch::Tensor run_between_hooks(torch::Tensor input, const ForwardFn& use);

  // Multi-line tree of modules with parameter shapes, for debugging and `loom info`.
  std::string describe();

 protected:
  // Runs pre-hooks on `input`, then `forward`, then post-hooks on the output. Layers route their
  // main tensor input through this so hooks see every call.
  template <typename F>
  torch::Tensor call_with_hooks(torch::Tensor input, F&& forward) {
    if (!has_forward_hooks()) return forward(input);
    input = run_pre_hooks(std::move(input));
    torch::Tensor output = hooks_->around ? hooks_->around(*this, input, ForwardFn(forward)) : forward(input);
    return run_post_hooks(input, std::move(output));
  }

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> module);
  void check_new_name(const std::string& name) const;
  torch::Tensor run_pre_hooks(torch::Tensor input);
  torch::Tensor run_post_hooks(const torch::Tensor& input, torch::Tensor output);
  template <typename Fn>
  void visit(const std::string& prefix, Fn&& fn);
  // Resolves "a.b.c" to (module owning "c", "c").
  std::pair<Module*, std::string> resolve(const std::string& path);

  std::string type_name_;
  std::vector<std::unique_ptr<ParameterSlot>> parameters_;
  std::vector<std::unique_ptr<BufferSlot>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::shared_ptr<detail::HookTable> hooks_;
  bool training_ = true;
};

// A container of modules keyed by string, in insertion order (TorchTitan keeps `layers` as a
// ModuleDict so a pipeline stage can drop some and keep the original layer ids in names).
class ModuleDict : public Module {
 public:
  ModuleDict() : Module("ModuleDict") {}
  template <typename M>
  std::shared_ptr<M> add(const std::string& key, std::shared_ptr<M> module) {
    return register_module(key, std::move(module));
  }
  size_t size() const { return named_children().size(); }
};

}  // namespace loom::nn
