// What `loom check-layouts` compares between a reference run and a layout, and the verdict it
// draws from a step's differences.
//
// Every difference is relative: losses and gradient norms |got - ref| / |ref|; tensors (a
// parameter's gradient or updated value, a module's activation or its gradient)
// ||got - ref|| / ||ref|| over the whole tensor (Frobenius). Not elementwise: after AdamW an element
// whose gradient is ~0 moves by up to lr per step in a direction rounding decides, so single
// elements of a correct layout differ by 2e-4 of a small tensor's largest element while the tensor
// agrees to ~4e-6 (train/tests/layout_runs.h, worst_parameter_difference).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace loom::layouts {

using TensorMap = std::map<std::string, torch::Tensor>;

// |got - ref| / |ref| (0 when both are 0, infinity when only ref is 0; NaN when either is NaN).
double relative_difference(double ref, double got);
// ||got - ref|| / ||ref|| in float64 (same conventions); infinity when the shapes differ.
double relative_difference(const torch::Tensor& ref, const torch::Tensor& got);

// The tensor with the largest relative difference (name empty and difference 0 when none differ).
struct WorstTensor {
  std::string name;
  double difference = 0;
};
// Over every tensor of `ref`; throws loom::Error naming a tensor `got` lacks or has extra.
WorstTensor worst_tensor(const TensorMap& ref, const TensorMap& got);

// One run's step as the Trainer reported it: the loss (mean over the global batch) and the
// gradient norm before clipping, what metrics.jsonl logs.
struct StepValues {
  int64_t step = 0;
  double loss = 0;
  double grad_norm = 0;
};

enum class Verdict {
  kMatch,      // everything within the tolerance
  kGradient,   // a parameter's gradient differs
  kNorm,       // every gradient equal, the norm differs
  kLoss,       // every gradient and the norm equal, the logged loss differs
  kParameter,  // gradients, norm and loss equal, an updated parameter differs
};

struct StepComparison {
  int64_t step = 0;
  StepValues ref, got;
  double loss_difference = 0;
  double norm_difference = 0;
  WorstTensor gradient;   // of the gradients (before clipping)
  WorstTensor parameter;  // of the parameters after the step's update
  Verdict verdict = Verdict::kMatch;
};

// Fills the differences' verdict: the first of gradient, norm, loss, updated parameter (in that
// order: a wrong gradient explains the rest, a wrong norm the updates) beyond `tolerance`.
Verdict verdict_of(const StepComparison& c, double tolerance);
// "ok", "gradient", "norm", "loss", "parameter" (the table's and the JSON's word).
const char* verdict_name(Verdict v);
// One line saying what differs and what it means, e.g. for kNorm
// "every gradient equal, the norm differs: a reduction error (norm 0.7899 vs 0.8642, 8.6e-02)".
std::string explain(const StepComparison& c, double tolerance);

// ---- Which module first differs (a step re-run with hooks) ----

// The activations of one step, gathered whole ([global rows, seq, ...]): each recorded module's
// output ("output") and the gradient of the loss with respect to it ("grad"), by module name.
struct StepActivations {
  TensorMap outputs;
  TensorMap grads;
  // The modules in the order their forwards finished (the reference's order decides).
  std::vector<std::string> order;
};

struct ModuleFinding {
  std::string module;  // the module named: "layers.1.attention", or "output" (the head and loss)
  std::string what;    // "output" (its forward) or "input gradient" (its backward)
  std::string at;      // the recorded tensor that differs, e.g. "layers.0.attention's output gradient"
  double difference = 0;
};

// The first module whose output differs, in forward order; if every output agrees, the module
// whose backward first produced a differing gradient: walking the recorded outputs from the last
// to the first, the first whose gradient differs is X, and the module after X (whose output's
// gradient still agreed) computed it, so that module's input gradient differs ("output", the head
// and loss, when X is the last). nullopt when every recorded tensor agrees. Modules missing from
// either run are skipped.
std::optional<ModuleFinding> first_differing_module(const StepActivations& ref, const StepActivations& got,
                                                    double tolerance);

}  // namespace loom::layouts
