// Differences between the libtorch versions Loom builds against (torch 2.13 CPU wheel in CI,
// 2.11 + CUDA on the GPU machine), kept in this one header instead of #ifs across files.
#pragma once
#include <torch/csrc/Export.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <string>
#include <utility>

// Adds a top-level key to the Kineto trace being recorded (torch.profiler's _add_metadata_json).
// Declared in torch/csrc/profiler/kineto_shim.h, which includes libkineto's <ActivityType.h>: the
// wheels ship it under include/kineto/, off the include path torch's CMake config sets, so the
// declaration is repeated here (same signature in torch 2.11 and 2.13).
namespace torch::autograd::profiler {
TORCH_API void addMetadataJson(const std::string& key, const std::string& value);
}  // namespace torch::autograd::profiler

namespace loom::compat {

// What torch::autograd::impl::grad_accumulator returns: c10::intrusive_ptr<Node> in torch 2.13,
// std::shared_ptr<Node> in 2.11. Holding it keeps the AccumulateGrad node (and the hooks
// registered on it) alive.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// Runs `fn` after a leaf's AccumulateGrad node has stored this backward's gradient in .grad; add it
// with compat::grad_accumulator-held nodes: grad_accumulator(t)->add_post_hook(make_unique<...>).
// It runs once per backward that reaches the node (not for autograd::grad captures of the leaf).
class AfterAccumulateGrad : public torch::autograd::FunctionPostHook {
 public:
  explicit AfterAccumulateGrad(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace loom::compat
