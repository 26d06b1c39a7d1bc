// Shared by the fused-kernel tests (test_fused.cpp, test_fused_generic.cpp): the elementwise
// closeness check and the loss-and-gradients runner of a linear + cross-entropy head.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace loom::nn::test_support {

// |a - b| <= atol + rtol * |b| elementwise (compared in fp64), worst offender in the message.
inline void expect_close(const torch::Tensor& a, const torch::Tensor& b, double rtol, double atol,
                         const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const torch::Tensor ad = a.to(torch::kFloat64), bd = b.to(torch::kFloat64);
  const torch::Tensor excess = (ad - bd).abs() - (atol + rtol * bd.abs());
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max |diff| " << (ad - bd).abs().max().item<double>() << ", max |ref| "
      << bd.abs().max().item<double>();
}

struct CEResult {
  torch::Tensor loss, d_hidden, d_weight;
};

// Loss and both gradients of `f` on fresh leaf copies of hidden and weight (their dtypes kept), the
// loss scaled by `loss_scale` before backward (as gradient accumulation does).
template <typename F>
CEResult run_ce(F f, const torch::Tensor& hidden, const torch::Tensor& weight, double loss_scale = 1.0) {
  torch::Tensor h = hidden.detach().clone().requires_grad_(true);
  torch::Tensor w = weight.detach().clone().requires_grad_(true);
  torch::Tensor loss = f(h, w);
  (loss_scale == 1.0 ? loss : loss * loss_scale).backward();
  return {loss.detach(), h.grad(), w.grad()};
}

}  // namespace loom::nn::test_support
