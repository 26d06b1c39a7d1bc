// One pipeline stage at run time: a module holding some of the model's layers, and per micro-batch
// the forward (input and output kept for the backward), the full backward B, and the zero-bubble
// split of the backward into I (gradient w.r.t. the stage input only) and W (the weight gradients,
// later). The executor (executor.h) drives stages action by action; the model-specific split into
// stages lives with the model (models/common/pipeline.h).
//
// Loss scaling: the last stage's output is the micro-batch's mean loss; its backward starts from
// loss_scale (1/m for m micro-batches), so the gradients summed over the step equal those of the
// mean loss over the global batch when every micro-batch has the same number of counted tokens.
//
// How W avoids redoing I's work (WeightGradMethod::kPerOp, the default). During a forward whose
// backward the schedule splits, post-hooks on every Linear, RMSNorm and Embedding of the stage keep
// each call's input x and output y. I asks autograd for the gradients of the stage input *and of
// every kept y* in one pass (retain_graph = false): the engine then skips each weight's gradient
// GEMM (its AccumulateGrad is not requested) and frees the graph. W computes the weight gradients
// directly from the kept (x, dy):
//   Linear     dW = dy^T x (db = sum dy)           one GEMM per call, as the backward's weight GEMM
//   RMSNorm    dγ = sum over rows of dy · x · rstd   rstd recomputed from x (one elementwise pass)
//   Embedding  dW = index_add of dy rows at the ids
// So I + W cost one backward, as B does, plus the rstd recomputation of the norms; between I and W
// the stage holds each op's x (already saved by the graph) and dy (one activation-sized tensor per
// parameter-consuming op). Parameters of modules that already carry forward hooks (a parallel
// style's), and parameters used outside those three layers (the fused output head's weight, whose
// gradient the fused loss already computed in its forward), get their gradients in I together with
// the input gradient; W only adds them to .grad.
//
// WeightGradMethod::kAutograd is the plain fallback: I = autograd::grad(out, input, retain_graph),
// W = autograd::backward(out, inputs = parameters). It keeps the whole graph alive until W and W
// re-runs the activation-gradient chain down to the earliest parameter, so I + W cost about 1.5 B.
// It goes through autograd's AccumulateGrad, which a parallelism hooking gradient accumulation
// (FSDP's reduce-scatter) may need. On the last stage I takes the weight gradients too (the fused
// head + loss hands its precomputed gradients out once and cannot be walked twice), so there the
// split is only in name.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/nn/attention.h"
#include "loom/nn/module.h"

namespace loom::pipeline {

// The stage's computation: input (tokens on the first stage, activations elsewhere), the
// micro-batch's labels (read by the last stage only) and its token layout (document ids for
// block-causal attention; default: causal rows) -> activations, or the loss on the last stage.
using StageForward = std::function<torch::Tensor(const torch::Tensor& input, const torch::Tensor& labels,
                                                 const nn::TokenLayout& layout)>;

enum class WeightGradMethod { kPerOp, kAutograd };

class PipelineStage {
 public:
  // `module` owns the stage's parameters; `forward` runs it. stage_index in [0, num_stages).
  // `not_hooked`: dotted paths of layers kPerOp must leave alone, because the forward reads their
  // parameters without calling them or checks them for hooks (Llama's output head, which the fused
  // loss reads directly and which would fall back to whole logits if it had a hook); their
  // parameters take the autograd path in I.
  PipelineStage(int stage_index, int num_stages, std::shared_ptr<nn::Module> module,
                StageForward forward, WeightGradMethod method = WeightGradMethod::kPerOp,
                const std::vector<std::string>& not_hooked = {});
  ~PipelineStage();
  PipelineStage(const PipelineStage&) = delete;
  PipelineStage& operator=(const PipelineStage&) = delete;

  int index() const { return index_; }
  int num_stages() const { return num_stages_; }
  bool is_first() const { return index_ == 0; }
  bool is_last() const { return index_ == num_stages_ - 1; }
  nn::Module& module() { return *module_; }
  const std::shared_ptr<nn::Module>& module_ptr() const { return module_; }
  WeightGradMethod weight_grad_method() const { return method_; }

  // The last stage's backward root gradient (1 / number of micro-batches).
  void set_loss_scale(double scale) { loss_scale_ = scale; }
  double loss_scale() const { return loss_scale_; }

  // Applied to micro-batch `mb`'s output (the activations passed on, or the last stage's loss)
  // inside the graph, before it is sent or its backward runs: fault injection (LOOM_FAULT_NAN
  // turns a rank's stage output into NaN, which reaches the pipeline's loss as a real divergence
  // would). Empty: none.
  using OutputHook = std::function<torch::Tensor(int mb, const torch::Tensor& output)>;
  void set_output_hook(OutputHook hook) { output_hook_ = std::move(hook); }

  // F: runs micro-batch `mb` and keeps what its backward needs. `split_backward`: the schedule runs
  // I + W for this micro-batch (kPerOp keeps the layers' inputs and outputs). Returns the output,
  // detached (activations to pass on, or the loss).
  torch::Tensor forward(int mb, const torch::Tensor& input, const torch::Tensor& labels,
                        bool split_backward = false, const nn::TokenLayout& layout = {});
  // B: input and weight gradients; weight gradients accumulate in the parameters' .grad. Returns
  // the gradient of the stage input (undefined on the first stage). `grad_output`: the gradient of
  // the output (ignored on the last stage, whose root is the loss times loss_scale).
  torch::Tensor backward(int mb, const torch::Tensor& grad_output);
  // I: the gradient of the stage input only (undefined on the first stage); W must follow.
  torch::Tensor backward_input(int mb, const torch::Tensor& grad_output);
  // W: the weight gradients of an earlier I, into .grad.
  void backward_weight(int mb);

  // Micro-batches with a forward whose backward has not finished.
  size_t num_pending() const { return pending_.size(); }
  // Drops every micro-batch's state (after a failed step).
  void clear() { pending_.clear(); }

 private:
  // One call of a parameter-consuming layer during a split forward (kPerOp).
  struct OpCall {
    nn::Module* module;
    torch::Tensor input;
    torch::Tensor output;
    torch::Tensor grad_output;  // set by I
  };
  struct MicroBatch {
    torch::Tensor input;   // leaf requiring grad (non-first stages)
    torch::Tensor output;  // attached to the graph
    bool split = false;
    bool input_done = false;  // I ran
    torch::Tensor grad_root;  // kAutograd: I's root gradient, for W
    std::vector<OpCall> ops;
    std::vector<torch::Tensor> other_grads;  // I's gradients of other_params_ (kPerOp)
  };

  MicroBatch& state(int mb, const char* what);
  // The root of the backward and its gradient.
  std::pair<torch::Tensor, torch::Tensor> root(const MicroBatch& s, const torch::Tensor& grad_output) const;
  // Adds `grad` to param.grad; `owned`: grad is a fresh tensor .grad may take over.
  static void accumulate(const torch::Tensor& param, const torch::Tensor& grad, bool owned);
  std::vector<torch::Tensor> trainable_parameters();

  int index_;
  int num_stages_;
  std::shared_ptr<nn::Module> module_;
  StageForward forward_;
  WeightGradMethod method_;
  double loss_scale_ = 1.0;
  OutputHook output_hook_;
  std::map<int, MicroBatch> pending_;
  std::vector<nn::HookHandle> hooks_;
  std::vector<OpCall>* capture_ = nullptr;  // where the hooks record, during a split forward
  // kPerOp: the parameters of the hooked layers; the others get their gradients in I. Slots, not
  // tensors: a parallelism may swap a slot's tensor after the stage is built.
  std::vector<nn::ParameterSlot*> covered_;
};

}  // namespace loom::pipeline
