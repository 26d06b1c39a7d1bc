// Differences between the libtorch versions Loom builds against (torch 2.13 CPU wheel in CI,
// 2.11 + CUDA on the GPU machine), kept in this one header instead of #ifs across files.
#pragma once
#include <torch/csrc/autograd/variable.h>

#include <utility>

namespace loom::compat {

// What torch::autograd::impl::grad_accumulator returns: c10::intrusive_ptr<Node> in torch 2.13,
// std::shared_ptr<Node> in 2.11. Holding it keeps the AccumulateGrad node (and the hooks
// registered on it) alive.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

}  // namespace loom::compat
