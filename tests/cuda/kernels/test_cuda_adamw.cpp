// Loom's AdamW CUDA kernel (optim/cuda/adamw_kernel.h) against at::_fused_adamw_ on the same
// tensors: five steps with weight decay, a gradient scale on some and a found_inf skip on one, over
// sizes that are and are not multiples of the vector width, and over views at odd offsets (the
// scalar path). Tolerance: rtol 1e-5, atol 1e-6 on float32 parameters of magnitude ~1 (both do the
// per-element math in float32; the step size and bias corrections are computed in double by both,
// then rounded; the order of the operations differs slightly).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "loom/optim/adamw.h"
#ifdef LOOM_WITH_CUDA_OPTIM_KERNELS
#include "loom/optim/cuda/adamw_kernel.h"
#endif

namespace adamw_kernel_test {

#ifdef LOOM_WITH_CUDA_OPTIM_KERNELS
struct State {
  torch::Tensor param, exp_avg, exp_avg_sq, step;
};

State make_state(const torch::Tensor& param) {
  return {param, torch::zeros_like(param), torch::zeros_like(param),
          torch::zeros({}, param.options().dtype(torch::kFloat))};
}

void expect_close(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  const torch::Tensor x = a.cpu(), y = b.cpu();
  ASSERT_FALSE(x.isnan().any().item<bool>()) << what;
  EXPECT_TRUE(torch::allclose(x, y, 1e-5, 1e-6)) << what << ": max |diff| " << (x - y).abs().max().item<double>();
}

// `loom` and `aten` hold views of equal values; five steps of each implementation.
void run_steps(std::vector<State> loom, std::vector<State> aten, const std::string& what) {
  const double lr = 1e-2, beta1 = 0.9, beta2 = 0.95, wd = 0.1, eps = 1e-8;
  for (int step = 1; step <= 5; ++step) {
    std::vector<torch::Tensor> grads;
    for (const State& s : loom) grads.push_back(torch::randn_like(s.param) * (step == 3 ? 1e3 : 1.0));
    const float scale = step == 2 ? 4.0f : 1.0f;
    const float inf = step == 4 ? 1.0f : 0.0f;
    const torch::Tensor grad_scale = torch::full({}, scale, torch::TensorOptions(torch::kCUDA));
    const torch::Tensor found_inf = torch::full({}, inf, torch::TensorOptions(torch::kCUDA));
    std::vector<torch::Tensor> params, gs, ms, vs, steps;
    for (size_t i = 0; i < loom.size(); ++i) {
      loom[i].step.add_(1.0);
      aten[i].step.add_(1.0);
      loom::optim::cuda::adamw_update_(loom[i].param, grads[i], loom[i].exp_avg, loom[i].exp_avg_sq, loom[i].step, lr,
                                       beta1, beta2, wd, eps, grad_scale, found_inf);
      loom[i].step.sub_(found_inf);
      params.push_back(aten[i].param);
      gs.push_back(grads[i].clone());
      ms.push_back(aten[i].exp_avg);
      vs.push_back(aten[i].exp_avg_sq);
      steps.push_back(aten[i].step);
    }
    at::_fused_adamw_(params, gs, ms, vs, {}, steps, lr, beta1, beta2, wd, eps, false, false, grad_scale, found_inf);
    for (auto& s : steps) s.sub_(found_inf);
    for (size_t i = 0; i < loom.size(); ++i) {
      const std::string at = what + " tensor " + std::to_string(i) + " step " + std::to_string(step);
      expect_close(loom[i].param, aten[i].param, at + " param");
      expect_close(loom[i].exp_avg, aten[i].exp_avg, at + " exp_avg");
      expect_close(loom[i].exp_avg_sq, aten[i].exp_avg_sq, at + " exp_avg_sq");
      EXPECT_EQ(loom[i].step.item<float>(), aten[i].step.item<float>()) << at;
    }
  }
}
#endif

TEST(CudaAdamWKernel, MatchesATenFusedAdamW) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_OPTIM_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  torch::manual_seed(0);
  std::vector<State> loom, aten;
  for (int64_t n : {1, 7, 4096 + 3, (1 << 20) + 1, 2048 * 512}) {
    const torch::Tensor p = torch::randn({n}, torch::TensorOptions(torch::kCUDA));
    loom.push_back(make_state(p.clone()));
    aten.push_back(make_state(p.clone()));
  }
  run_steps(loom, aten, "aligned");
  // Views at odd offsets of one flat buffer (an FSDP shard's slices): the scalar path.
  const torch::Tensor flat = torch::randn({10001}, torch::TensorOptions(torch::kCUDA));
  std::vector<State> a, b;
  const torch::Tensor fa = flat.clone(), fb = flat.clone();
  State sa = make_state(fa), sb = make_state(fb);
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{1, 4002}, {4002, 4003}, {4003, 10001}}) {
    a.push_back({fa.slice(0, begin, end), sa.exp_avg.slice(0, begin, end), sa.exp_avg_sq.slice(0, begin, end),
                 torch::zeros({}, torch::TensorOptions(torch::kCUDA))});
    b.push_back({fb.slice(0, begin, end), sb.exp_avg.slice(0, begin, end), sb.exp_avg_sq.slice(0, begin, end),
                 torch::zeros({}, torch::TensorOptions(torch::kCUDA))});
  }
  run_steps(a, b, "odd offsets");
#endif
}

// Through optim::AdamW: the kernel on (the default) and off give the same parameters.
TEST(CudaAdamWKernel, AdamWClassWithAndWithoutTheKernelAgree) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device";
#ifndef LOOM_WITH_CUDA_OPTIM_KERNELS
  GTEST_SKIP() << "skipped: no CUDA device (CPU build of libtorch)";
#else
  torch::manual_seed(1);
  const torch::Tensor w = torch::randn({256, 64}, torch::TensorOptions(torch::kCUDA));
  const torch::Tensor n = torch::randn({64}, torch::TensorOptions(torch::kCUDA));
  loom::optim::NamedTensors on = {{"layer.weight", w.clone()}, {"norm.weight", n.clone()}};
  loom::optim::NamedTensors off = {{"layer.weight", w.clone()}, {"norm.weight", n.clone()}};
  loom::optim::AdamW a(loom::optim::weight_decay_param_groups(on, 0.1), {.lr = 1e-2});
  loom::optim::AdamW b(loom::optim::weight_decay_param_groups(off, 0.1), {.lr = 1e-2});
  EXPECT_TRUE(loom::optim::cuda_adamw_kernel_built());
  for (int step = 0; step < 4; ++step) {
    const torch::Tensor gw = torch::randn_like(w), gn = torch::randn_like(n);
    const auto grads = [&](const loom::optim::AdamW& opt) {
      std::vector<std::vector<torch::Tensor>> out;
      for (const auto& group : opt.param_groups()) {
        auto& g = out.emplace_back();
        for (const auto& name : group.param_names) g.push_back(name == "layer.weight" ? gw.clone() : gn.clone());
      }
      return out;
    };
    loom::optim::set_cuda_adamw_kernel(true);
    a.step(grads(a));
    loom::optim::set_cuda_adamw_kernel(false);
    b.step(grads(b));
  }
  loom::optim::set_cuda_adamw_kernel(true);
  for (size_t i = 0; i < on.size(); ++i) expect_close(on[i].second, off[i].second, on[i].first);
#endif
}

}  // namespace adamw_kernel_test
