#include "loom/pipeline/stage.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <unordered_set>

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/nn/layers.h"

namespace loom::pipeline {

PipelineStage::PipelineStage(int stage_index, int num_stages, std::shared_ptr<nn::Module> module,
                             StageForward forward, WeightGradMethod method,
                             const std::vector<std::string>& not_hooked)
    : index_(stage_index),
      num_stages_(num_stages),
      module_(std::move(module)),
      forward_(std::move(forward)),
      method_(method) {
  LOOM_REQUIRE(num_stages > 0 && stage_index >= 0 && stage_index < num_stages, "stage ",
               stage_index, " of ", num_stages, " stages");
  LOOM_REQUIRE(module_ != nullptr && forward_ != nullptr, "stage ", stage_index,
               " needs a module and a forward");
  if (method_ != WeightGradMethod::kPerOp) return;
  for (const auto& [name, m] : module_->named_modules()) {
    const bool known = dynamic_cast<nn::Linear*>(m) != nullptr ||
                       dynamic_cast<nn::RMSNorm*>(m) != nullptr ||
                       dynamic_cast<nn::Embedding*>(m) != nullptr;
    // A module that already has hooks computes something other than its plain math (a parallel
    // style's collectives): its parameters take the autograd path in I.
    if (!known || m->has_forward_hooks()) continue;
    if (std::find(not_hooked.begin(), not_hooked.end(), name) != not_hooked.end()) continue;
    for (const auto& p : m->named_parameters(/*recurse=*/false)) covered_.push_back(p.slot);
    hooks_.push_back(m->add_forward_post_hook(
        [this](nn::Module& mod, torch::Tensor input, torch::Tensor output) {
          if (capture_ != nullptr && output.requires_grad()) {
            capture_->push_back({&mod, input, output, {}});
          }
          return output;
        }));
  }
}

PipelineStage::~PipelineStage() {
  for (auto& h : hooks_) h.remove();
}

std::vector<torch::Tensor> PipelineStage::trainable_parameters() {
  std::vector<torch::Tensor> out;
  for (const auto& p : module_->named_parameters()) {
    if (p.tensor().requires_grad()) out.push_back(p.tensor());
  }
  return out;
}

PipelineStage::MicroBatch& PipelineStage::state(int mb, const char* what) {
  auto it = pending_.find(mb);
  LOOM_REQUIRE(it != pending_.end(), "stage ", index_, ": ", what, " of micro-batch ", mb,
               " without its forward");
  return it->second;
}

torch::Tensor PipelineStage::forward(int mb, const torch::Tensor& input,
                                     const torch::Tensor& labels, bool split_backward,
                                     const nn::TokenLayout& layout) {
  LOOM_REQUIRE(pending_.count(mb) == 0, "stage ", index_, ": second forward of micro-batch ", mb,
               " before its backward");
  RECORD_USER_SCOPE("loom::forward");  // profiler range, as without a pipeline
  MicroBatch s;
  s.split = split_backward;
  // The stage input becomes a leaf of this stage's graph: its gradient is what goes back.
  s.input = is_first() ? input : input.detach().requires_grad_(true);
  torch::AutoGradMode grad_mode(true);
  capture_ = (split_backward && method_ == WeightGradMethod::kPerOp) ? &s.ops : nullptr;
  try {
    s.output = forward_(s.input, labels, layout);
  } catch (...) {
    capture_ = nullptr;
    throw;
  }
  capture_ = nullptr;
  if (output_hook_) s.output = output_hook_(mb, s.output);
  LOOM_REQUIRE(!is_last() || s.output.numel() == 1, "stage ", index_,
               ": the last stage must return the loss, got shape ", s.output.sizes());
  torch::Tensor result = s.output.detach();
  pending_.emplace(mb, std::move(s));
  return result;
}

std::pair<torch::Tensor, torch::Tensor> PipelineStage::root(const MicroBatch& s,
                                                            const torch::Tensor& grad_output) const {
  if (is_last()) return {s.output, torch::full_like(s.output, loss_scale_)};
  LOOM_REQUIRE(grad_output.defined() && grad_output.sizes() == s.output.sizes(), "stage ", index_,
               ": output gradient of shape ",
               grad_output.defined() ? c10::str(grad_output.sizes()) : std::string("(none)"),
               " for an output of shape ", s.output.sizes());
  return {s.output, grad_output};
}

torch::Tensor PipelineStage::backward(int mb, const torch::Tensor& grad_output) {
  MicroBatch& s = state(mb, "B");
  LOOM_REQUIRE(!s.input_done, "stage ", index_, ": B of micro-batch ", mb, " after its I");
  RECORD_USER_SCOPE("loom::backward");
  auto [r, g] = root(s, grad_output);
  // Accumulates into every leaf: the parameters' .grad and the stage input's.
  torch::autograd::backward({r}, {g}, /*retain_graph=*/false, /*create_graph=*/false);
  torch::Tensor grad_input = is_first() ? torch::Tensor() : s.input.grad();
  LOOM_REQUIRE(is_first() || grad_input.defined(), "stage ", index_,
               ": the output does not depend on the input");
  pending_.erase(mb);
  return grad_input;
}

torch::Tensor PipelineStage::backward_input(int mb, const torch::Tensor& grad_output) {
  MicroBatch& s = state(mb, "I");
  LOOM_REQUIRE(!s.input_done, "stage ", index_, ": second I of micro-batch ", mb);
  RECORD_USER_SCOPE("loom::backward_input");
  auto [r, g] = root(s, grad_output);
  s.input_done = true;
  torch::Tensor grad_input;
  if (method_ == WeightGradMethod::kAutograd && !is_last()) {
    // Keeps the graph for W, which walks it again down to the parameters.
    s.grad_root = g;
    if (!is_first()) {
      grad_input = torch::autograd::grad({r}, {s.input}, {g}, /*retain_graph=*/true)[0];
    }
    return grad_input;
  }
  if (method_ == WeightGradMethod::kAutograd) {
    // The last stage's loss may not support a second pass over a retained graph (the fused head
    // hands its precomputed gradients out once), so its weight gradients are taken here, in the
    // same pass as the input gradient; W adds them.
    std::vector<torch::Tensor> params = trainable_parameters();
    std::vector<torch::Tensor> wanted = params;
    if (!is_first()) wanted.push_back(s.input);
    std::vector<torch::Tensor> grads = torch::autograd::grad(
        {r}, wanted, {g}, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
    s.other_grads.clear();
    for (size_t i = 0; i < params.size(); ++i) {
      if (grads[i].defined()) s.other_grads.push_back(params[i]), s.other_grads.push_back(grads[i]);
    }
    if (!is_first()) grad_input = grads.back();
    s.output = torch::Tensor();
    return grad_input;
  }
  // kPerOp: one pass for the input gradient and the gradient of every kept layer output; the
  // weight GEMMs are not requested, so the engine skips them, and the graph is freed.
  LOOM_REQUIRE(s.split, "stage ", index_, ": I of micro-batch ", mb,
               " whose forward was not told the backward is split");
  std::unordered_set<const nn::ParameterSlot*> covered(covered_.begin(), covered_.end());
  std::vector<torch::Tensor> others;
  for (const auto& p : module_->named_parameters()) {
    if (p.tensor().requires_grad() && covered.count(p.slot) == 0) others.push_back(p.tensor());
  }
  std::vector<torch::Tensor> wanted;
  if (!is_first()) wanted.push_back(s.input);
  for (const OpCall& op : s.ops) wanted.push_back(op.output);
  for (const auto& t : others) wanted.push_back(t);
  std::vector<torch::Tensor> grads =
      torch::autograd::grad({r}, wanted, {g}, /*retain_graph=*/false, /*create_graph=*/false,
                            /*allow_unused=*/true);
  size_t k = 0;
  if (!is_first()) grad_input = grads[k++];
  for (OpCall& op : s.ops) {
    op.grad_output = grads[k++];
    op.output = torch::Tensor();  // only its gradient is needed now
  }
  // Parameters outside the hooked layers: their gradients are done; W adds them.
  s.other_grads.clear();
  for (size_t i = 0; i < others.size(); ++i, ++k) {
    if (grads[k].defined()) {
      s.other_grads.push_back(others[i]);
      s.other_grads.push_back(grads[k]);
    }
  }
  s.output = torch::Tensor();
  LOOM_REQUIRE(is_first() || grad_input.defined(), "stage ", index_,
               ": the output does not depend on the input");
  return grad_input;
}

void PipelineStage::accumulate(const torch::Tensor& param, const torch::Tensor& grad, bool owned) {
  torch::Tensor& slot = const_cast<torch::Tensor&>(param).mutable_grad();
  torch::Tensor value = grad.to(param.scalar_type());
  if (!slot.defined()) {
    slot = (owned && value.is_contiguous()) ? value.detach() : value.detach().clone();
    memory::note_gradient_bytes(slot.device(), static_cast<int64_t>(slot.nbytes()));  // accounting
  } else {
    slot.add_(value);
  }
}

void PipelineStage::backward_weight(int mb) {
  MicroBatch& s = state(mb, "W");
  LOOM_REQUIRE(s.input_done, "stage ", index_, ": W of micro-batch ", mb, " before its I");
  RECORD_USER_SCOPE("loom::backward_weight");
  if (method_ == WeightGradMethod::kAutograd && s.grad_root.defined()) {
    const std::vector<torch::Tensor> params = trainable_parameters();
    if (!params.empty()) {
      torch::autograd::backward({s.output}, {s.grad_root}, /*retain_graph=*/false,
                                /*create_graph=*/false, params);
    }
    pending_.erase(mb);
    return;
  }
  torch::NoGradGuard no_grad;
  for (const OpCall& op : s.ops) {
    if (!op.grad_output.defined()) continue;  // the output did not reach the loss
    const torch::Tensor& dy = op.grad_output;
    if (auto* linear = dynamic_cast<nn::Linear*>(op.module)) {
      const torch::Tensor& w = linear->parameter_slot("weight").tensor;
      const torch::Tensor dy2 = dy.reshape({-1, linear->out_features()});
      const torch::Tensor x2 = op.input.reshape({-1, linear->in_features()}).to(dy.scalar_type());
      if (w.requires_grad()) accumulate(w, dy2.t().mm(x2), /*owned=*/true);
      if (linear->has_bias()) {
        const torch::Tensor& b = linear->parameter_slot("bias").tensor;
        if (b.requires_grad()) accumulate(b, dy2.sum(0), /*owned=*/true);
      }
    } else if (auto* norm = dynamic_cast<nn::RMSNorm*>(op.module)) {
      const torch::Tensor& w = norm->parameter_slot("weight").tensor;
      if (!w.requires_grad()) continue;
      const int64_t dim = w.size(0);
      const torch::Tensor x = op.input.to(torch::kFloat32);
      const torch::Tensor rstd = (x.pow(2).mean(-1, /*keepdim=*/true) + norm->eps()).rsqrt();
      accumulate(w, (dy.to(torch::kFloat32) * x * rstd).reshape({-1, dim}).sum(0), /*owned=*/true);
    } else if (auto* embedding = dynamic_cast<nn::Embedding*>(op.module)) {
      const torch::Tensor& w = embedding->parameter_slot("weight").tensor;
      if (!w.requires_grad()) continue;
      torch::Tensor dw = torch::zeros(w.sizes(), dy.options());
      dw.index_add_(0, op.input.reshape({-1}), dy.reshape({-1, embedding->embedding_dim()}));
      accumulate(w, dw, /*owned=*/true);
    } else {
      LOOM_REQUIRE(false, "stage ", index_, ": no weight gradient for a ", op.module->type_name());
    }
  }
  for (size_t i = 0; i + 1 < s.other_grads.size(); i += 2) {
    accumulate(s.other_grads[i], s.other_grads[i + 1], /*owned=*/false);
  }
  pending_.erase(mb);
}

}  // namespace loom::pipeline
