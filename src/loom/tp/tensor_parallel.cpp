#include "loom/tp/tensor_parallel.h"

#include <cstdlib>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/lora/lora.h"
#include "loom/tp/collective_matmul.h"

namespace loom::tp {

TensorParallel::TensorParallel(tensor::CommPtr comm, bool sequence_parallel, bool async_tp)
    : comm_(std::move(comm)), sequence_parallel_(sequence_parallel), async_tp_(async_tp) {
  LOOM_REQUIRE(comm_ != nullptr, "TensorParallel needs a comm");
  // The run's settings were checked against each other before (train/compatibility.cpp).
  LOOM_REQUIRE(!async_tp || sequence_parallel, "async tensor parallelism needs sequence parallelism");
}

void TensorParallel::shard_parameter(nn::Module& module, const std::string& fqn,
                                     const std::string& name, int64_t dim) {
  nn::ParameterSlot& slot = module.parameter_slot(name);
  const std::string param = fqn.empty() ? name : fqn + "." + name;
  tensor::TensorLayout layout;
  layout.global_shape = slot.tensor.sizes().vec();
  layout.placements = {{kMeshDim, tensor::Shard{dim}, rank(), degree()}};
  const tensor::Box box = layout.local_box();  // validates divisibility, naming the tensor
  torch::Tensor local;
  if (slot.tensor.is_meta()) {
    local = torch::empty(box.sizes, slot.tensor.options());
  } else {
    torch::NoGradGuard no_grad;
    local = slot.tensor.narrow(dim, box.offsets[dim], box.sizes[dim]).clone();
  }
  module.set_parameter(name, local);
  module.parameter_slot(name).layout = layout;
  layouts_[param] = layout;
}

namespace {

// Fault injection for tests (like the Trainer's LOOM_FAULT_*): LOOM_FAULT_SKIP_TP_REDUCE=<text>
// makes every rowwise linear whose path contains <text> (e.g. "layers.1.attention") skip its
// reduction over tp, keeping its own partial sums (under sequence parallelism, its own sequence
// shard of them): a broken layout `loom check-layouts` must name (layouts/tests). Never set in a
// real run.
bool skips_tp_reduce(const std::string& fqn) {
  const char* pattern = std::getenv("LOOM_FAULT_SKIP_TP_REDUCE");
  return pattern != nullptr && *pattern != '\0' && fqn.find(pattern) != std::string::npos;
}

}  // namespace

void TensorParallel::reduce_partial_output(nn::Module& module, const std::string& fqn) {
  if (skips_tp_reduce(fqn)) {
    log::warn("LOOM_FAULT_SKIP_TP_REDUCE: ", fqn, " skips its reduction over tp (fault injection)");
    module.add_forward_post_hook([this](nn::Module&, torch::Tensor, torch::Tensor out) {
      if (!sequence_parallel_) return out;
      const int64_t part = out.size(kSequenceDim) / degree();
      return out.narrow(kSequenceDim, part * rank(), part);
    });
    return;
  }
  // Each rank's output is its addend of the full result.
  module.add_forward_post_hook([this](nn::Module&, torch::Tensor, torch::Tensor out) {
    return sequence_parallel_ ? tensor::reduce_scatter(out, kSequenceDim, comm_)
                              : tensor::all_reduce(out, comm_);
  });
}

void TensorParallel::colwise(nn::Linear& linear, const std::string& fqn) {
  shard_parameter(linear, fqn, "weight", 0);
  if (linear.has_bias()) shard_parameter(linear, fqn, "bias", 0);
  // A LoRA adapter follows its base: B's output rows split like the weight's, A replicated (each
  // rank's B rows give part of A's gradient, summed over the group).
  if (nn::Module* adapter = linear.find_submodule(lora::kAdapterName)) {
    const std::string path = (fqn.empty() ? "" : fqn + ".") + lora::kAdapterName;
    shard_parameter(*adapter, path, "b", 0);
    partial_grads_.push_back(path + ".a");
  }
}

void TensorParallel::rowwise(nn::Linear& linear, const std::string& fqn) {
  shard_parameter(linear, fqn, "weight", 1);
  // A bias stays replicated and is added once, after the reduction (each rank's linear computes its
  // partial sum without it). Under SP each rank adds it to its own tokens only, so its gradient is
  // a partial sum over the group.
  if (linear.has_bias()) {
    linear.set_bias_outside(true);
    if (sequence_parallel_) partial_grads_.push_back((fqn.empty() ? "" : fqn + ".") + "bias");
  }
  nn::Linear* biased = linear.has_bias() ? &linear : nullptr;
  auto add_bias = [biased](nn::Module&, torch::Tensor, torch::Tensor out) {
    return out + biased->parameter("bias");
  };
  // A LoRA adapter follows its base: A's input columns split like the weight's, B replicated; the
  // adapter's output is then a partial sum like the base's, reduced with it.
  if (nn::Module* adapter = linear.find_submodule(lora::kAdapterName)) {
    LOOM_REQUIRE(!async_tp_, "LoRA with async tensor parallelism (refused by train/compatibility.cpp)");
    const std::string path = (fqn.empty() ? "" : fqn + ".") + lora::kAdapterName;
    shard_parameter(*adapter, path, "a", 1);
    partial_grads_.push_back(path + ".b");
  }
  if (async_tp_) {
    linear.set_forward_override([this](nn::Module& m, const torch::Tensor& x, const nn::ForwardFn&) {
      return matmul_reduce_scatter(x, static_cast<nn::Linear&>(m).weight(), kSequenceDim, comm_);
    });
    if (biased) linear.add_forward_post_hook(add_bias);
    return;
  }
  reduce_partial_output(linear, fqn);
  if (biased) linear.add_forward_post_hook(add_bias);  // after the reduction's post-hook
}

void TensorParallel::headwise(nn::Module& module, const std::string& fqn, const std::string& name) {
  // The attention runs on this rank's heads for every token (SP gathers the sequence before it),
  // so the shard's gradient is whole: nothing to sum.
  shard_parameter(module, fqn, name, 0);
}

void TensorParallel::rowwise_embedding(nn::Embedding& embedding, const std::string& fqn) {
  shard_parameter(embedding, fqn, "weight", 0);
  const int64_t rows = layouts_.at(fqn.empty() ? "weight" : fqn + ".weight").local_box().sizes[0];
  const int64_t start = rows * rank();
  // The ids this rank does not own look up row 0 and are zeroed after: the pre-hook hands the
  // mask to the post-hook (a module's forward runs its hooks in order, one call at a time).
  auto foreign = std::make_shared<torch::Tensor>();
  embedding.add_forward_pre_hook([foreign, start, rows](nn::Module&, torch::Tensor ids) {
    const torch::Tensor local = ids - start;
    *foreign = (local < 0).logical_or(local >= rows);
    return local.masked_fill(*foreign, 0);
  });
  embedding.add_forward_post_hook([this, foreign](nn::Module&, torch::Tensor, torch::Tensor out) {
    torch::Tensor mine = out.masked_fill(foreign->unsqueeze(-1), 0.0);
    foreign->reset();
    return sequence_parallel_ ? tensor::reduce_scatter(mine, kSequenceDim, comm_)
                              : tensor::all_reduce(mine, comm_);
  });
}

void TensorParallel::prepare_input(nn::Module& module, const std::vector<nn::Linear*>& consumers) {
  if (async_tp_ && !consumers.empty()) {
    // The gather and the consumers' matmuls in one collective matmul. The results wait here until
    // each consumer's forward asks for them with the gathered input (a consumer called with any
    // other input, or twice, computes as usual).
    struct Pending {
      const c10::TensorImpl* input = nullptr;
      std::vector<torch::Tensor> outputs;
    };
    auto pending = std::make_shared<Pending>();
    module.add_forward_pre_hook([this, consumers, pending](nn::Module&, torch::Tensor x) {
      std::vector<torch::Tensor> weights;
      for (nn::Linear* linear : consumers) {
        LOOM_REQUIRE(!linear->has_bias(), "async tensor parallel: a colwise linear with a bias is not supported");
        weights.push_back(linear->weight());
      }
      GatheredMatmul fused = all_gather_matmul(x, weights, kSequenceDim, comm_);
      pending->input = fused.input.unsafeGetTensorImpl();
      pending->outputs = std::move(fused.outputs);
      return fused.input;
    });
    for (size_t i = 0; i < consumers.size(); ++i) {
      consumers[i]->set_forward_override(
          [pending, i](nn::Module&, const torch::Tensor& x, const nn::ForwardFn& forward) {
            if (pending->input != x.unsafeGetTensorImpl() || !pending->outputs[i].defined()) return forward(x);
            return std::exchange(pending->outputs[i], torch::Tensor());
          });
    }
    return;
  }
  module.add_forward_pre_hook([this](nn::Module&, torch::Tensor x) {
    // The module's weights are sharded: each rank's gradient of its input is a partial sum.
    return sequence_parallel_ ? tensor::all_gather(x, kSequenceDim, comm_, tensor::ReplicatedGrad::kPartial)
                              : tensor::all_reduce_in_backward(x, comm_);
  });
}

void TensorParallel::sequence_parallel(nn::RMSNorm& norm, const std::string& fqn) {
  (void)norm;
  // Without SP the norm sees every token on every rank and its gradient is already complete.
  if (sequence_parallel_) partial_grads_.push_back(fqn.empty() ? "weight" : fqn + ".weight");
}

void TensorParallel::replicate_partial_grad(nn::Module& module, const std::string& fqn) {
  for (const auto& p : module.named_parameters()) {
    // A parameter another parallelism already split (an MoE layer's experts under expert
    // parallelism) has its gradient completed by that parallelism: summing it here would add
    // other ranks' pieces.
    if (p.slot->layout) continue;
    partial_grads_.push_back(fqn.empty() ? p.name : fqn + "." + p.name);
  }
}

void TensorParallel::colwise_output(nn::Linear& output, const std::string& fqn, bool loss_parallel) {
  colwise(output, fqn);
  prepare_input(output);
  if (!loss_parallel) {
    output.add_forward_post_hook([this](nn::Module&, torch::Tensor, torch::Tensor logits) {
      // The loss after it is the same on every rank: each rank's gradient is whole.
      return tensor::all_gather(logits, -1, comm_, tensor::ReplicatedGrad::kIdentical);
    });
  }
}

tensor::TensorLayout TensorParallel::layout_of(const std::string& fqn,
                                               const std::vector<int64_t>& local_shape) const {
  auto it = layouts_.find(fqn);
  if (it != layouts_.end()) return it->second;
  tensor::TensorLayout layout = tensor::TensorLayout::replicated(local_shape);
  layout.placements = {{kMeshDim, tensor::Replicate{}, rank(), degree()}};
  return layout;
}

void TensorParallel::sum_partial_gradients(const std::vector<torch::Tensor>& grads) const {
  std::vector<torch::Tensor> defined;
  for (const auto& g : grads) {
    if (g.defined() && g.numel() > 0) defined.push_back(g);
  }
  if (defined.empty() || degree() == 1) return;
  std::vector<torch::Tensor> flat;
  for (const auto& g : defined) flat.push_back(g.reshape({-1}));
  torch::Tensor bucket = torch::cat(flat);
  comm_->all_reduce(bucket, distributed::ReduceOp::kSum);
  int64_t offset = 0;
  torch::NoGradGuard no_grad;
  for (auto& g : defined) {
    g.copy_(bucket.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
}

void TensorParallel::init_local(const std::string& fqn, torch::Tensor& local, const InitFn& init) const {
  auto it = layouts_.find(fqn);
  if (it == layouts_.end()) {
    init(fqn, local);
    return;
  }
  torch::Tensor full = torch::empty(it->second.global_shape, local.options());
  init(fqn, full);
  const tensor::Box box = it->second.local_box();
  torch::Tensor piece = full;
  for (size_t d = 0; d < box.sizes.size(); ++d) piece = piece.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
  torch::NoGradGuard no_grad;
  local.copy_(piece);
}

// ---- Loss parallel ------------------------------------------------------------------------------

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& labels, int64_t vocab_start,
                               const tensor::CommPtr& comm, int64_t ignore_index, int64_t chunk_tokens) {
    const int64_t n = hidden.size(0);
    const int64_t vocab_local = weight.size(0);
    const torch::Tensor valid = labels != ignore_index;
    // The same on every rank of the group (labels are replicated): the mean's denominator.
    const int64_t num_valid = valid.sum().item<int64_t>();
    const double scale = 1.0 / static_cast<double>(std::max<int64_t>(num_valid, 1));
    const bool need_grad = hidden.requires_grad() || weight.requires_grad();
    torch::Tensor grad_hidden = need_grad ? torch::empty_like(hidden) : torch::Tensor();
    torch::Tensor grad_weight =
        need_grad ? torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32)) : torch::Tensor();
    torch::Tensor loss_sum = torch::zeros({}, hidden.options().dtype(torch::kFloat64));
    for (int64_t begin = 0; begin < n; begin += chunk_tokens) {
      const int64_t len = std::min(chunk_tokens, n - begin);
      const torch::Tensor h = hidden.narrow(0, begin, len);
      const torch::Tensor y = labels.narrow(0, begin, len);
      const torch::Tensor ok = valid.narrow(0, begin, len);
      torch::Tensor logits = at::linear(h, weight).to(torch::kFloat32);  // [len, vocab_local]
      // Softmax statistics over the whole vocabulary: max, then sum of exp, then the target's logit
      // (only the rank owning the label contributes it).
      torch::Tensor row_max = std::get<0>(logits.max(1));
      comm->all_reduce(row_max, distributed::ReduceOp::kMax);
      torch::Tensor exp = (logits - row_max.unsqueeze(1)).exp_();
      const torch::Tensor local_label = y - vocab_start;
      const torch::Tensor mine = ok.logical_and(local_label >= 0).logical_and(local_label < vocab_local);
      const torch::Tensor index = local_label.clamp(0, vocab_local - 1).unsqueeze(1);
      torch::Tensor target = logits.gather(1, index).squeeze(1).masked_fill(mine.logical_not(), 0.0);
      torch::Tensor stats = torch::stack({exp.sum(1), target});  // [2, len]: one all-reduce
      comm->all_reduce(stats, distributed::ReduceOp::kSum);
      const torch::Tensor sum_exp = stats[0], target_logit = stats[1];
      const torch::Tensor token_loss = (sum_exp.log() + row_max - target_logit).masked_fill(ok.logical_not(), 0.0);
      loss_sum += token_loss.to(torch::kFloat64).sum();
      if (!need_grad) continue;
      // d loss / d logits = (softmax - onehot) / num_valid on valid tokens.
      torch::Tensor dlogits = exp.div_(sum_exp.unsqueeze(1));
      dlogits.scatter_add_(1, index, -mine.to(torch::kFloat32).unsqueeze(1));
      dlogits.mul_(ok.to(torch::kFloat32).unsqueeze(1) * scale);
      grad_hidden.narrow(0, begin, len).copy_(at::mm(dlogits.to(weight.scalar_type()), weight));
      grad_weight.addmm_(dlogits.t(), h.to(torch::kFloat32));
    }
    if (need_grad) {
      ctx->saved_data["grad_hidden"] = grad_hidden;
      ctx->saved_data["grad_weight"] = grad_weight.to(weight.scalar_type());
    }
    return (loss_sum * scale).to(hidden.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const torch::Tensor g = grad_out[0];
    torch::Tensor grad_hidden = ctx->saved_data["grad_hidden"].toTensor() * g.to(torch::kFloat32);
    torch::Tensor grad_weight = ctx->saved_data["grad_weight"].toTensor() * g.to(torch::kFloat32);
    return {grad_hidden, grad_weight, {}, {}, {}, {}, {}};
  }
};

}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight_local,
                                           const torch::Tensor& labels, int64_t vocab_start,
                                           const tensor::CommPtr& comm, int64_t ignore_index,
                                           int64_t chunk_tokens) {
  LOOM_REQUIRE(hidden.dim() == 2 && weight_local.dim() == 2 && hidden.size(1) == weight_local.size(1),
               "vocab_parallel_cross_entropy needs hidden [N, dim] and weight [vocab/t, dim], got ",
               hidden.sizes(), " and ", weight_local.sizes());
  LOOM_REQUIRE(labels.dim() == 1 && labels.size(0) == hidden.size(0) && labels.scalar_type() == torch::kInt64,
               "vocab_parallel_cross_entropy needs int64 labels [", hidden.size(0), "], got ",
               labels.scalar_type(), " ", labels.sizes());
  LOOM_REQUIRE(chunk_tokens > 0, "chunk_tokens must be > 0, got ", chunk_tokens);
  return VocabParallelCrossEntropy::apply(hidden, weight_local, labels, vocab_start, comm, ignore_index,
                                          chunk_tokens);
}

}  // namespace loom::tp
