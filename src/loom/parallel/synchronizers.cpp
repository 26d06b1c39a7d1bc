#include "loom/parallel/synchronizers.h"

#include "loom/core/error.h"
#include "loom/cp/ring_attention.h"
#include "loom/parallel/parameter_storage.h"

namespace loom::parallel {

std::string TensorParallelSync::describe() const {
  return c10::str("TP ", tp_->degree(), tp_->sequence_parallel() ? " (sequence parallel)" : "");
}

void TensorParallelSync::finish(ParameterStorage& storage) {
  if (tp_->partial_gradient_parameters().empty()) return;
  const NamedGradients grads = storage.local_gradients();
  std::vector<torch::Tensor> partial;
  for (const std::string& name : tp_->partial_gradient_parameters()) {
    for (const auto& [n, g] : grads) {
      if (n == name) partial.push_back(g);
    }
  }
  tp_->sum_partial_gradients(partial);
}

tensor::CommPtr TensorParallelSync::norm_comm(const std::string& param) const {
  return tp_->is_sharded(param) ? tp_->comm() : nullptr;
}

std::string ContextParallelSync::describe() const { return c10::str("CP ", cp_->size()); }

void ContextParallelSync::prepare_batch(ModelBatch& batch) const {
  if (cp_->size() == 1) return;
  const int rank = cp_->rank(), degree = cp_->size();
  const torch::Tensor tokens = batch.tokens;
  batch.tokens = cp::shard_sequence(tokens, 1, rank, degree);
  batch.labels = cp::shard_sequence(batch.labels, 1, rank, degree);
  batch.layout.positions = cp::sequence_positions(tokens.size(1), rank, degree).to(tokens.device());
  if (batch.layout.document_ids.defined()) {
    batch.layout.document_ids = cp::shard_sequence(batch.layout.document_ids, 1, rank, degree);
  }
}

std::string FsdpSync::describe() const {
  const auto& mesh = fsdp_.front().mesh();
  // The groups say how the blocks were bucketed (one all-gather and one reduce-scatter each).
  const size_t groups = fsdp_.param_groups().size();
  return mesh.replicate_size() > 1
             ? c10::str("HSDP ", mesh.replicate_size(), "x", mesh.shard_size(), ", ", groups, " groups")
             : c10::str("FSDP over ", mesh.shard_size(), " ranks, ", groups, " groups");
}

std::string ReplicaAverageSync::describe() const {
  return replicas_->size() > 1 ? c10::str("DP ", replicas_->size(), " replicas") : std::string();
}

void ReplicaAverageSync::finish(ParameterStorage& storage) {
  if (replicas_->size() <= 1) return;
  std::vector<torch::Tensor> grads, flats;
  for (const auto& [name, g] : storage.local_gradients()) {
    if (g.defined() && g.numel() > 0) grads.push_back(g), flats.push_back(g.reshape(-1));
  }
  if (grads.empty()) return;
  torch::Tensor flat = torch::cat(flats);
  replicas_->all_reduce(flat, distributed::ReduceOp::kAvg);
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
}

std::string PipelineSync::describe() const {
  const pipeline::Schedule& s = executor_->schedule();
  return c10::str("PP ", s.num_ranks, " (", s.name, ", ", s.num_microbatches, " micro-batches of ", microbatch_size_,
                  " rows, ", s.stages_per_rank, s.stages_per_rank == 1 ? " stage" : " stages", " per rank)");
}

}  // namespace loom::parallel
