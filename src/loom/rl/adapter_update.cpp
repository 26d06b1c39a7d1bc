#include "loom/rl/adapter_update.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.h"
#include "loom/lora/lora.h"
#include "loom/optim/clip_grad.h"
#include "loom/parallel/optimizer_registry.h"

namespace loom::rl {
namespace {
constexpr const char* kOptimizerPrefix = "optimizer.";
constexpr const char* kSchedulePrefix = "lr_scheduler.";
}  // namespace

AdapterOptimizer::AdapterOptimizer(models::Decoder& model, const train::JobConfig& job, int64_t total_updates)
    : max_norm_(job.training.max_norm) {
  for (const auto& p : model.named_parameters()) {
    if (p.tensor().requires_grad()) trained_.emplace_back(p.name, p.tensor());
  }
  LOOM_REQUIRE(!trained_.empty(), "loom rl: the model has no trainable parameter (no LoRA adapter applied)");
  const parallel::OptimizerSpec& spec = parallel::optimizer_spec(job.optimizer.name);
  const parallel::OptimizerRequest request = job.optimizer.request();
  if (spec.check_layout) {
    parallel::OptimizerLayout layout;
    layout.device = trained_.front().second.device().str();
    spec.check_layout(request, layout);
  }
  optimizer_ = spec.build(trained_, request);
  schedule_ = std::make_unique<optim::LRScheduler>(*optimizer_, job.lr_scheduler, total_updates);
}

AdapterOptimizer::Update AdapterOptimizer::step(const torch::Tensor& loss, const GradientInspector& inspect) {
  optimizer_->zero_grad(/*set_to_none=*/true);
  loss.backward();
  if (inspect) inspect(trained_);
  std::vector<torch::Tensor> grads;
  for (const auto& [name, param] : trained_) {
    if (param.grad().defined()) grads.push_back(param.grad());
  }
  // As ParallelizedModel::clip_grad_norm_: max_norm 0 reports the norm without clipping.
  const torch::Tensor norm =
      max_norm_ > 0 ? optim::clip_grad_norm_(grads, max_norm_) : optim::total_grad_norm(grads);
  Update out;
  out.grad_norm = norm.item<double>();
  out.lr = optimizer_->lr();
  LOOM_REQUIRE(std::isfinite(out.grad_norm) && std::isfinite(loss.item<double>()), "loom rl: non-finite GRPO loss (",
               loss.item<double>(), ") or gradient norm (", out.grad_norm,
               "); the adapters were not updated; lower optimizer.lr or training.max_norm");
  optimizer_->step();
  schedule_->step();
  return out;
}

optim::TensorDict AdapterOptimizer::state_dict() const {
  optim::TensorDict out;
  for (const auto& [k, v] : optimizer_->state_dict()) out.emplace(kOptimizerPrefix + k, v);
  for (const auto& [k, v] : schedule_->state_dict()) out.emplace(kSchedulePrefix + k, v);
  return out;
}

void AdapterOptimizer::load_state_dict(const optim::TensorDict& state) {
  optim::TensorDict optimizer, schedule;
  for (const auto& [k, v] : state) {
    if (k.rfind(kOptimizerPrefix, 0) == 0) {
      optimizer.emplace(k.substr(std::string(kOptimizerPrefix).size()), v);
    } else if (k.rfind(kSchedulePrefix, 0) == 0) {
      schedule.emplace(k.substr(std::string(kSchedulePrefix).size()), v);
    } else {
      LOOM_REQUIRE(false, "loom rl state: unexpected entry '", k, "'");
    }
  }
  optimizer_->load_state_dict(optimizer);
  schedule_->load_state_dict(schedule);
}

torch::Tensor recomputed_logprobs(models::Decoder& model, const Batch& batch, double temperature) {
  torch::NoGradGuard no_grad;
  return token_logprobs(model, batch, temperature);
}

torch::Tensor reference_logprobs(models::Decoder& model, const Batch& batch, double temperature) {
  torch::NoGradGuard no_grad;
  std::vector<lora::Adapter*> adapters;
  for (const auto& [path, module] : model.named_modules()) {
    if (auto* adapter = dynamic_cast<lora::Adapter*>(module)) adapters.push_back(adapter);
  }
  for (lora::Adapter* adapter : adapters) adapter->set_enabled(false);
  torch::Tensor ref = token_logprobs(model, batch, temperature);
  for (lora::Adapter* adapter : adapters) adapter->set_enabled(true);
  return ref;
}

PolicyUpdate update_policy(models::Decoder& model, AdapterOptimizer& optimizer, const Batch& batch,
                           const torch::Tensor& old, const torch::Tensor& ref, const torch::Tensor& advantages,
                           const GrpoOptions& grpo, double temperature, int64_t updates,
                           const GradientInspector& inspect) {
  PolicyUpdate out;
  for (int64_t update = 0; update < updates; ++update) {
    const torch::Tensor logp = token_logprobs(model, batch, temperature);
    if (update == 0) out.max_logp_diff = ((logp.detach() - old) * batch.mask).abs().max().item<double>();
    // In float64, as parallel_loop.cpp: the per-token terms are of order 1 and cancel to about the
    // update's size, so a float32 sum's rounding would be a visible share of the loss (and differ
    // from a parallel run's, which sums in another order).
    const auto f64 = [&](const torch::Tensor& t) { return t.defined() ? t.to(logp.device(), torch::kFloat64) : t; };
    out.loss = grpo_loss(f64(logp), f64(old), f64(ref), f64(advantages), f64(batch.mask), grpo);
    const AdapterOptimizer::Update step = optimizer.step(out.loss.loss, inspect);
    out.grad_norm = step.grad_norm;
    out.lr = step.lr;
  }
  return out;
}

}  // namespace loom::rl
