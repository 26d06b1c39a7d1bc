#include "loom/parallel/parallelized_model.h"

#include <ATen/record_function.h>

#include "loom/cp/ring_attention.h"

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/optim/clip_grad.h"

namespace loom::parallel {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The parameter an AdamW state entry belongs to ("<param>.exp_avg" -> "<param>"); empty for state
// that is not shaped like its parameter (the step counts).
std::string moment_parameter(const std::string& key) {
  for (const char* suffix : {".exp_avg_sq", ".exp_avg", ".momentum_buffer"}) {
    if (ends_with(key, suffix)) return key.substr(0, key.size() - std::string(suffix).size());
  }
  return "";
}

// Sum of squares of a list of gradients, fp32, on their device (zero for an empty list).
torch::Tensor sum_of_squares(const std::vector<torch::Tensor>& grads, const torch::TensorOptions& options) {
  if (grads.empty()) return torch::zeros({}, options);
  std::vector<torch::Tensor> norms = at::_foreach_norm(grads, 2);
  for (auto& n : norms) n = n.to(torch::kFloat32);
  return at::stack(norms).pow(2).sum();
}

}  // namespace

ParallelizedModel::ParallelizedModel(ParallelParts parts) : parts_(std::move(parts)) {
  LOOM_REQUIRE(!parts_.modules.empty(), "ParallelizedModel needs the model's parts");
  for (const auto& m : parts_.modules) LOOM_REQUIRE(m != nullptr, "ParallelizedModel: a null model part");
  LOOM_REQUIRE(parts_.forward_loss || parts_.pipeline, "ParallelizedModel needs the model's loss or a pipeline");
  LOOM_REQUIRE(!parts_.pipeline || parts_.pipeline_microbatch_size > 0,
               "a pipelined model needs its micro-batch size");
  LOOM_REQUIRE(!(parts_.fsdp && parts_.ddp), "FSDP and DDP on the same parameters: HSDP replicates "
               "through FSDP (dp_replicate), not DDP");
  if (parts_.pipeline && parts_.fsdp) {
    // FSDP inside the stage: gradients accumulate unsharded over the micro-batches (and the
    // accumulated batches) and are reduce-scattered once, by the stage's last backward of the
    // step's last batch.
    LOOM_REQUIRE(!parts_.pipeline->splits_backward(), "FSDP inside pipeline stages with a zero-bubble split");
    // Under reshard_after_forward = never the parameters also stay gathered from the first
    // forward to that last backward: one all-gather per group per step (ZeRO-2); otherwise each
    // micro-batch's forward and backward gather them (ZeRO-3's memory).
    const bool keep_gathered = parts_.fsdp->policy().reshard_after_forward == fsdp::ReshardAfterForward::never();
    parts_.pipeline->set_before_backward([this, keep_gathered](pipeline::PipelineStage&, bool last) {
      const bool step_ends = last && pipeline_batch_is_last_;
      parts_.fsdp->set_requires_gradient_sync(step_ends);
      if (keep_gathered) parts_.fsdp->set_reshard_after_backward(step_ends);
    });
  }
  if (!gradients_persist()) {
    // Memory accounting (core/memory.h): gradients set to None between steps are created again by
    // each step's backward; the first one of each parameter in a step is counted as a gradient
    // rather than an activation. A hook after the parameter's AccumulateGrad node, which runs once
    // per backward that reaches it (a tensor hook would also run for autograd::grad captures,
    // which activation checkpointing makes).
    for (const auto& p : named_parameters()) {
      if (!p.slot->requires_grad || !p.slot->tensor.requires_grad()) continue;
      const size_t i = gradient_accumulators_.size();
      nn::ParameterSlot* slot = p.slot;
      auto accumulator = torch::autograd::impl::grad_accumulator(slot->tensor);
      accumulator->add_post_hook(std::make_unique<compat::AfterAccumulateGrad>([this, i, slot] {
        if (gradient_counted_[i] || !slot->tensor.grad().defined()) return;
        gradient_counted_[i] = 1;
        memory::note_gradient_bytes(slot->tensor.device(), static_cast<int64_t>(slot->tensor.grad().nbytes()));
      }));
      gradient_accumulators_.push_back(std::move(accumulator));
    }
    gradient_counted_.assign(gradient_accumulators_.size(), 0);
  }
}

std::string ParallelizedModel::describe() const {
  std::string out;
  if (parts_.tp) {
    out += c10::str("TP ", parts_.tp->degree(), parts_.tp->sequence_parallel() ? " (sequence parallel)" : "");
  }
  if (parts_.fsdp) {
    const auto& mesh = parts_.fsdp->mesh();
    out += c10::str(out.empty() ? "" : " + ", mesh.replicate_size() > 1 ? "HSDP " : "FSDP over ",
                    mesh.replicate_size() > 1 ? c10::str(mesh.replicate_size(), "x", mesh.shard_size())
                                              : c10::str(mesh.shard_size(), " ranks"));
  }
  if (parts_.ddp) out += out.empty() ? "DDP" : " + DDP";
  if (parts_.pipeline) {
    const pipeline::Schedule& s = parts_.pipeline->schedule();
    if (parts_.pipeline_replicas && parts_.pipeline_replicas->size() > 1) {
      out += c10::str(out.empty() ? "" : " + ", "DP ", parts_.pipeline_replicas->size(), " replicas");
    }
    out += c10::str(out.empty() ? "" : " x ", "PP ", s.num_ranks, " (", s.name, ", ", s.num_microbatches,
                    " micro-batches of ", parts_.pipeline_microbatch_size, " rows, ", s.stages_per_rank,
                    s.stages_per_rank == 1 ? " stage" : " stages", " per rank)");
  }
  return out.empty() ? "one rank" : out;
}

void ParallelizedModel::begin_micro_batch(bool last) {
  if (parts_.ddp) parts_.ddp->set_gradient_sync(last);
  // FSDP accumulates unsharded gradients locally and reduce-scatters once, on the last one.
  if (parts_.fsdp) parts_.fsdp->set_requires_gradient_sync(last);
}

ModelBatch ParallelizedModel::prepare_batch(const torch::Tensor& tokens, const torch::Tensor& labels,
                                            const torch::Tensor& document_ids) const {
  ModelBatch batch{tokens, labels, {torch::Tensor(), document_ids}};
  if (!parts_.cp || parts_.cp->size() == 1) return batch;
  const int rank = parts_.cp->rank(), degree = parts_.cp->size();
  batch.tokens = cp::shard_sequence(tokens, 1, rank, degree);
  batch.labels = cp::shard_sequence(labels, 1, rank, degree);
  batch.layout.positions = cp::sequence_positions(tokens.size(1), rank, degree).to(tokens.device());
  if (document_ids.defined()) batch.layout.document_ids = cp::shard_sequence(document_ids, 1, rank, degree);
  return batch;
}

std::vector<nn::NamedParameter> ParallelizedModel::named_parameters() {
  std::vector<nn::NamedParameter> out;
  for (const auto& m : parts_.modules) {
    for (auto& p : m->named_parameters()) out.push_back(std::move(p));
  }
  return out;
}

torch::Tensor ParallelizedModel::forward_backward(const std::vector<ModelBatch>& batches, const LossHook& hook) {
  LOOM_REQUIRE(!batches.empty(), "forward_backward needs at least one batch");
  if (parts_.pipeline) return pipeline_forward_backward(batches, hook);
  const auto k = static_cast<int64_t>(batches.size());
  // The step's loss is summed on the device and read back by the caller once, with the gradient
  // norm: no host-device sync per micro-batch.
  torch::Tensor loss_sum;
  for (int64_t i = 0; i < k; ++i) {
    begin_micro_batch(/*last=*/i + 1 == k);
    torch::Tensor loss;
    {
      // Profiler ranges (profiling/profiler.h): FSDP's all-gathers nest in the forward, its
      // reduce-scatters in the backward.
      RECORD_USER_SCOPE("loom::forward");
      loss = parts_.forward_loss(batches[static_cast<size_t>(i)]);
      if (hook) loss = hook(i, loss);
    }
    const torch::Tensor part = loss.detach().to(torch::kFloat64) / static_cast<double>(k);
    loss_sum = loss_sum.defined() ? loss_sum + part : part;
    // Mean over micro-batches: each contributes 1/k of the step's gradient.
    RECORD_USER_SCOPE("loom::backward");
    (k > 1 ? loss / static_cast<double>(k) : loss).backward();
  }
  finish_gradient_sync();
  return loss_sum;
}

torch::Tensor ParallelizedModel::forward_loss(const ModelBatch& batch) {
  LOOM_REQUIRE(!parts_.pipeline, "a forward-only loss is not available with pipeline parallelism");
  return parts_.forward_loss(batch);
}

torch::Tensor ParallelizedModel::pipeline_forward_backward(const std::vector<ModelBatch>& batches,
                                                           const LossHook& hook) {
  pipeline::PipelineExecutor& executor = *parts_.pipeline;
  const int m = executor.schedule().num_microbatches;
  const int64_t rows = parts_.pipeline_microbatch_size;
  const auto k = static_cast<int64_t>(batches.size());
  // Each micro-batch's mean loss enters the backward scaled by 1 / (m k): the step's gradient is
  // that of the mean loss over all m k micro-batches, as without a pipeline.
  for (const auto& stage : executor.stages()) {
    if (stage->is_last()) stage->set_loss_scale(1.0 / static_cast<double>(m * k));
  }
  double loss = 0;
  for (int64_t b = 0; b < k; ++b) {
    const ModelBatch& batch = batches[static_cast<size_t>(b)];
    pipeline_batch_is_last_ = b == k - 1;
    LOOM_REQUIRE(batch.tokens.size(0) == rows * m, "pipeline step: a batch of ", batch.tokens.size(0),
                 " rows is not ", m, " micro-batches of ", rows);
    std::vector<torch::Tensor> inputs, labels;
    std::vector<nn::TokenLayout> layouts;
    for (int i = 0; i < m; ++i) {
      inputs.push_back(batch.tokens.narrow(0, i * rows, rows));
      labels.push_back(batch.labels.narrow(0, i * rows, rows));
      // Every stage masks attention by document and, under context parallelism, places its chunks
      // by their positions; every rank has the rows (they are loaded on all pp ranks), so the ids
      // and positions travel with no message.
      const auto& layout = batch.layout;
      if (layout.document_ids.defined() || layout.positions.defined()) {
        layouts.push_back({layout.positions, layout.document_ids.defined()
                                                 ? layout.document_ids.narrow(0, i * rows, rows)
                                                 : torch::Tensor()});
      }
    }
    // The hook sees micro-batch b * m + i, as without a pipeline it sees batch b (one per step):
    // it acts on this rank's stage outputs, so a NaN injected on any pipeline rank reaches the
    // loss that every pp rank reads.
    for (const auto& stage : executor.stages()) {
      if (!hook) break;
      stage->set_output_hook([&hook, b, m](int mb, const torch::Tensor& out) {
        return hook(b * m + mb, out);
      });
    }
    struct ClearHooks {
      pipeline::PipelineExecutor& executor;
      ~ClearHooks() {
        for (const auto& stage : executor.stages()) stage->set_output_hook(nullptr);
      }
    } clear_hooks{executor};
    loss += executor.step(inputs, labels, layouts) / static_cast<double>(k);
  }
  finish_gradient_sync();
  return torch::tensor(loss, torch::kFloat64);
}

void ParallelizedModel::finish_gradient_sync() {
  RECORD_USER_SCOPE("loom::gradient_sync");
  if (parts_.ddp) parts_.ddp->finish_gradient_sync();
  if (parts_.fsdp) parts_.fsdp->finalize_backward();
  if (parts_.tp && !parts_.tp->partial_gradient_parameters().empty()) {
    const auto grads = local_gradients();
    std::vector<torch::Tensor> partial;
    for (const std::string& name : parts_.tp->partial_gradient_parameters()) {
      for (const auto& [n, g] : grads) {
        if (n == name) partial.push_back(g);
      }
    }
    parts_.tp->sum_partial_gradients(partial);
  }
  if (parts_.pipeline_replicas && parts_.pipeline_replicas->size() > 1) {
    // DDP's average over the pipeline's replicas, once per step after the whole schedule (a
    // stage's weight gradients come from several actions per micro-batch, so there is no single
    // last hook to overlap with): one flat buffer, one all-reduce. Sums commute with TP's above.
    std::vector<torch::Tensor> grads, flats;
    for (const auto& [name, g] : local_gradients()) {
      if (g.defined() && g.numel() > 0) grads.push_back(g), flats.push_back(g.reshape(-1));
    }
    if (grads.empty()) return;
    torch::Tensor flat = torch::cat(flats);
    parts_.pipeline_replicas->all_reduce(flat, distributed::ReduceOp::kAvg);
    int64_t offset = 0;
    for (auto& g : grads) {
      g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
  }
}

void ParallelizedModel::zero_grad() {
  if (parts_.ddp) {
    parts_.ddp->zero_grad();  // the gradients are views into its buckets: zero, do not drop
  } else if (parts_.fsdp) {
    parts_.fsdp->zero_grad();
  } else {
    for (const auto& m : parts_.modules) m->zero_grad(/*set_to_none=*/true);
    std::fill(gradient_counted_.begin(), gradient_counted_.end(), 0);
  }
}

std::vector<std::pair<std::string, torch::Tensor>> ParallelizedModel::local_gradients() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  if (parts_.fsdp) {
    for (fsdp::FSDPParamGroup* group : parts_.fsdp->param_groups()) {
      for (const auto& p : group->params()) out.emplace_back(parts_.fsdp->param_fqn(*group, p), p.sharded_grad);
    }
    return out;
  }
  for (const auto& p : named_parameters()) {
    if (p.slot->requires_grad) out.emplace_back(p.name, p.slot->tensor.grad());
  }
  return out;
}

std::vector<torch::Tensor> ParallelizedModel::resident_parameters() {
  std::vector<torch::Tensor> out;
  if (parts_.fsdp) {
    // The unsharded parameters are views of FSDP's releasable buffers: buffers in flight.
    for (fsdp::FSDPParamGroup* group : parts_.fsdp->param_groups()) out.push_back(group->sharded_params());
    return out;
  }
  for (const auto& p : named_parameters()) out.push_back(p.slot->tensor);
  return out;
}

std::vector<torch::Tensor> ParallelizedModel::resident_gradients() {
  std::vector<torch::Tensor> out;
  for (const auto& [name, g] : local_gradients()) out.push_back(g);
  return out;
}

torch::Tensor ParallelizedModel::grad_norm() {
  if (!parts_.pipeline && !parts_.tp) {
    // Data parallelism alone: the norms the FSDP and plain paths always computed.
    if (parts_.fsdp) return parts_.fsdp->grad_norm();
    std::vector<torch::Tensor> grads;
    for (const auto& [name, g] : local_gradients()) grads.push_back(g);
    return optim::total_grad_norm(grads);
  }
  // Squares grouped by the mesh dims they are sharded over, one all-reduce per group: TP-sharded
  // pieces are summed over tp, TP-replicated ones counted once; both over FSDP's shard group first
  // (HSDP replicas and pipeline replicas hold identical averaged gradients: counted once); then,
  // with a pipeline, everything over pp (each parameter lives on one pp rank).
  LOOM_REQUIRE(!(parts_.pipeline && parts_.ddp), "pipeline stages with DDP");
  if (parts_.fsdp) parts_.fsdp->finalize_backward();
  std::vector<torch::Tensor> sharded, replicated;
  torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32);
  for (const auto& [name, g] : local_gradients()) {
    if (!g.defined() || g.numel() == 0) continue;
    options = options.device(g.device());
    (parts_.tp && parts_.tp->is_sharded(name) ? sharded : replicated).push_back(g);
  }
  torch::Tensor both = at::stack({sum_of_squares(sharded, options), sum_of_squares(replicated, options)});
  if (parts_.fsdp) parts_.fsdp->mesh().shard->all_reduce(both, distributed::ReduceOp::kSum);
  torch::Tensor squares = both.narrow(0, 0, 1).clone();
  if (parts_.tp) parts_.tp->comm()->all_reduce(squares, distributed::ReduceOp::kSum);
  squares = squares + both.narrow(0, 1, 1);
  if (parts_.pipeline) parts_.pipeline->comm().all_reduce(squares, distributed::ReduceOp::kSum);
  return squares[0].sqrt();
}

torch::Tensor ParallelizedModel::clip_grad_norm_(double max_norm) {
  LOOM_REQUIRE_USAGE(max_norm > 0, "clip_grad_norm_ needs max_norm > 0, got ", max_norm);
  // FSDP alone clips its flat shards (the same elements as the per-parameter pieces, plus zero
  // padding) in one list.
  if (!parts_.pipeline && !parts_.tp && parts_.fsdp) return parts_.fsdp->clip_grad_norm_(max_norm);
  const torch::Tensor norm = grad_norm();
  std::vector<torch::Tensor> grads;
  for (const auto& [name, g] : local_gradients()) {
    if (g.defined() && g.numel() > 0) grads.push_back(g);
  }
  optim::clip_grads_with_norm_(grads, max_norm, norm);
  return norm;
}

std::unique_ptr<optim::Optimizer> ParallelizedModel::build_optimizer(const OptimizerSpec& spec,
                                                                     const OptimizerRequest& request,
                                                                     const c10::Device& device) {
  if (spec.check_layout) {
    OptimizerLayout layout;
    layout.tensor_parallel_degree = parts_.tp ? parts_.tp->comm()->size() : 1;
    layout.device = device.str();
    if (parts_.fsdp) {
      const auto& mp = parts_.fsdp->policy().mixed_precision;
      layout.half_precision_shards = mp.param_dtype == c10::kBFloat16 || mp.reduce_dtype == c10::kBFloat16;
    }
    spec.check_layout(request, layout);
  }
  if (parts_.fsdp) return spec.build_sharded(parts_.fsdp, request);
  optim::NamedTensors trainable;
  for (const auto& p : named_parameters()) {
    if (p.slot->requires_grad) trainable.emplace_back(p.name, p.slot->tensor);
  }
  return spec.build(trainable, request);
}

void ParallelizedModel::add_piece(checkpoint::ShardedStateDict& state, const std::string& name,
                                  const std::string& component, const std::string& param,
                                  const torch::Tensor& local, std::vector<int64_t> fsdp_shape,
                                  std::optional<int64_t> fsdp_offset) {
  const bool tp_sharded = parts_.tp && parts_.tp->is_sharded(param);
  std::optional<tensor::TensorLayout> layout;
  tensor::Box box;
  if (tp_sharded) {
    layout = parts_.tp->layout_of(param, fsdp_offset ? fsdp_shape : local.sizes().vec());
    box = layout->local_box();
  }
  if (!fsdp_offset) {  // this rank holds its whole piece
    if (tp_sharded) {
      state.add_box(name, component, layout->global_shape, box.offsets, local);
    } else {
      state.add_full(name, component, local);
    }
    return;
  }
  // FSDP: a flat range of the tensor FSDP sharded, which under TP is this rank's TP box.
  std::vector<checkpoint::LocalChunk> chunks;
  if (local.defined() && local.numel() > 0) {
    checkpoint::LocalChunk chunk{*fsdp_offset, local};
    if (tp_sharded) chunk.box_offsets = box.offsets, chunk.box_sizes = box.sizes;
    chunks.push_back(std::move(chunk));
  }
  const auto dtype = local.defined() ? local.scalar_type() : c10::kFloat;
  state.add_chunks(name, component, tp_sharded ? layout->global_shape : std::move(fsdp_shape), dtype,
                   std::move(chunks));
}

void ParallelizedModel::add_to_state_dict(checkpoint::ShardedStateDict& state, optim::Optimizer& optimizer) {
  if (parts_.fsdp) {
    for (const auto& st : parts_.fsdp->sharded_state_dict()) {
      add_piece(state, st.name, checkpoint::kModelComponent, st.name, st.local, st.global_shape, st.global_offset);
    }
    const auto* sharded = dynamic_cast<const fsdp::ShardedOptimizer*>(&optimizer);
    LOOM_REQUIRE(sharded, "an FSDP model's optimizer must keep its state on the shards (fsdp::ShardedOptimizer); "
                 "build it with build_optimizer");
    const std::vector<fsdp::ShardedTensor> optimizer_pieces = sharded->sharded_state_dict();
    // AdamW8bit's codes are shaped like their parameter and its scales are [numel / block] with
    // the piece's block offset; Muon's momentum buffers are whole matrices on their owner and empty
    // elsewhere: all reshard as flat ranges like the parameters.
    for (const auto& st : optimizer_pieces) {
      add_piece(state, "optimizer." + st.name, checkpoint::kOptimizerComponent, moment_parameter(st.name),
                st.local, st.global_shape, st.global_offset);
    }
    // Step counts are per group and identical on every rank: saved whole, under the same names
    // as the unsharded AdamW's, so a checkpoint moves between FSDP and non-FSDP layouts.
    for (const auto& [name, t] : optimizer.state_dict()) {
      if (ends_with(name, ".step")) state.add_full("optimizer." + name, checkpoint::kOptimizerComponent, t);
    }
    return;
  }
  for (const auto& p : named_parameters()) {
    add_piece(state, p.name, checkpoint::kModelComponent, p.name, p.slot->tensor.detach(), {}, std::nullopt);
  }
  for (const auto& [name, t] : optimizer.state_dict()) {
    add_piece(state, "optimizer." + name, checkpoint::kOptimizerComponent, moment_parameter(name), t, {},
              std::nullopt);
  }
}

void ParallelizedModel::load_full_parameters(const optim::TensorDict& full) {
  // Under TP, each parameter's piece first: what FSDP (or the module) holds whole.
  optim::TensorDict pieces;
  for (const auto& [name, value] : full) {
    torch::Tensor piece = value;
    if (parts_.tp && parts_.tp->is_sharded(name)) {
      const tensor::Box box = parts_.tp->layout_of(name, {}).local_box();
      for (size_t d = 0; d < box.sizes.size(); ++d) {
        piece = piece.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
      }
    }
    pieces[name] = piece;
  }
  if (parts_.fsdp) {
    parts_.fsdp->load_full_state_dict(pieces);
    return;
  }
  auto params = named_parameters();
  // A pipeline rank holds some of the parameters; the others' values are for the other ranks.
  LOOM_REQUIRE(params.size() == pieces.size() || (parts_.pipeline && params.size() < pieces.size()),
               "initial weights have ", pieces.size(), " parameters but the model has ", params.size(),
               "; check model.flavor and model.vocab_size");
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    auto it = pieces.find(p.name);
    LOOM_REQUIRE(it != pieces.end(), "initial weights have no parameter '", p.name,
                 "'; check model.flavor and model.vocab_size");
    LOOM_REQUIRE(it->second.sizes() == p.tensor().sizes(), "initial weight '", p.name, "' ",
                 it->second.sizes(), " does not match the model's ", p.tensor().sizes(),
                 "; check model.flavor and model.vocab_size");
    p.slot->tensor.detach().copy_(it->second);
  }
}

}  // namespace loom::parallel
