// Differences between the libtorch versions Loom builds against (torch 2.13 CPU wheel in CI,
// 2.11 + CUDA on the GPU machine), kept in this one header instead of #ifs across files.
#pragma once
#include <torch/csrc/Export.h>
#include <torch/csrc/autograd/variable.h>

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

}  // namespace loom::compat
