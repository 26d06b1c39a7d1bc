#include "loom/layouts/compare.h"

#include <cmath>
#include <limits>

#include "loom/core/error.h"

namespace loom::layouts {

double relative_difference(double ref, double got) {
  if (std::isnan(ref) || std::isnan(got)) return std::numeric_limits<double>::quiet_NaN();
  const double diff = std::abs(got - ref);
  if (diff == 0) return 0;
  return ref == 0 ? std::numeric_limits<double>::infinity() : diff / std::abs(ref);
}

double relative_difference(const torch::Tensor& ref, const torch::Tensor& got) {
  if (ref.sizes() != got.sizes()) return std::numeric_limits<double>::infinity();
  const torch::Tensor r = ref.detach().to(torch::kCPU, torch::kFloat64);
  const torch::Tensor g = got.detach().to(torch::kCPU, torch::kFloat64);
  const double diff = (g - r).norm().item<double>();
  const double scale = r.norm().item<double>();
  if (std::isnan(diff)) return std::numeric_limits<double>::quiet_NaN();
  if (diff == 0) return 0;
  return scale == 0 ? std::numeric_limits<double>::infinity() : diff / scale;
}

namespace {

// Whether difference `a` is worse than `b`: NaN is the worst of all.
bool worse(double a, double b) {
  if (std::isnan(b)) return false;
  return std::isnan(a) || a > b;
}

}  // namespace

WorstTensor worst_tensor(const TensorMap& ref, const TensorMap& got) {
  WorstTensor worst;
  for (const auto& [name, r] : ref) {
    const auto it = got.find(name);
    LOOM_REQUIRE(it != got.end(), "the layout has no tensor '", name, "' (the reference has)");
    const double d = relative_difference(r, it->second);
    if (worst.name.empty() || worse(d, worst.difference)) worst = {name, d};
  }
  for (const auto& [name, g] : got) {
    LOOM_REQUIRE(ref.count(name) > 0, "the layout has a tensor '", name, "' the reference has not");
  }
  return worst;
}

namespace {

bool beyond(double difference, double tolerance) { return std::isnan(difference) || difference > tolerance; }

}  // namespace

Verdict verdict_of(const StepComparison& c, double tolerance) {
  if (beyond(c.gradient.difference, tolerance)) return Verdict::kGradient;
  if (beyond(c.norm_difference, tolerance)) return Verdict::kNorm;
  if (beyond(c.loss_difference, tolerance)) return Verdict::kLoss;
  if (beyond(c.parameter.difference, tolerance)) return Verdict::kParameter;
  return Verdict::kMatch;
}

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::kMatch: return "ok";
    case Verdict::kGradient: return "gradient";
    case Verdict::kNorm: return "norm";
    case Verdict::kLoss: return "loss";
    case Verdict::kParameter: return "parameter";
  }
  return "?";
}

std::string explain(const StepComparison& c, double tolerance) {
  switch (c.verdict) {
    case Verdict::kMatch:
      return c10::str("step ", c.step, ": everything within ", tolerance);
    case Verdict::kGradient:
      return c10::str("step ", c.step, ": the gradient of ", c.gradient.name, " differs by ", c.gradient.difference,
                      " (relative, Frobenius)");
    case Verdict::kNorm:
      return c10::str("step ", c.step, ": every gradient equal, the norm differs: a reduction error (norm ",
                      c.got.grad_norm, " vs the reference's ", c.ref.grad_norm, ", ", c.norm_difference, " relative)");
    case Verdict::kLoss:
      return c10::str("step ", c.step, ": every gradient and the norm equal, the loss differs: an error in the "
                      "logged loss's reduction (", c.got.loss, " vs the reference's ", c.ref.loss, ", ",
                      c.loss_difference, " relative)");
    case Verdict::kParameter:
      return c10::str("step ", c.step, ": gradients, norm and loss equal, the updated value of ", c.parameter.name,
                      " differs by ", c.parameter.difference, " (relative, Frobenius): the optimizer step");
  }
  return "";
}

std::optional<ModuleFinding> first_differing_module(const StepActivations& ref, const StepActivations& got,
                                                    double tolerance) {
  // The modules both runs recorded, in the reference's order.
  std::vector<std::string> order;
  for (const std::string& m : ref.order) {
    if (ref.outputs.count(m) && got.outputs.count(m)) order.push_back(m);
  }
  for (const std::string& m : order) {
    const double d = relative_difference(ref.outputs.at(m), got.outputs.at(m));
    if (beyond(d, tolerance)) return ModuleFinding{m, "output", m + "'s output", d};
  }
  for (size_t i = order.size(); i-- > 0;) {
    const std::string& m = order[i];
    const auto r = ref.grads.find(m);
    const auto g = got.grads.find(m);
    if (r == ref.grads.end() || g == got.grads.end()) continue;
    const double d = relative_difference(r->second, g->second);
    if (beyond(d, tolerance)) {
      const std::string by = i + 1 < order.size() ? order[i + 1] : std::string("output");
      return ModuleFinding{by, "input gradient", m + "'s output gradient", d};
    }
  }
  return std::nullopt;
}

}  // namespace loom::layouts
