#include "loom/ep/expert_parallel.h"

#include "loom/core/error.h"

namespace loom::ep {

ExpertParallel::ExpertParallel(tensor::CommPtr comm) : comm_(std::move(comm)) {
  LOOM_REQUIRE(comm_ != nullptr, "ExpertParallel needs a comm");
}

void ExpertParallel::apply(moe::MoE& moe, const std::string& fqn) {
  moe::GroupedExperts& experts = moe.experts();
  const int64_t n_experts = experts.n_experts();
  LOOM_REQUIRE_USAGE(n_experts % degree() == 0, "parallelism.expert_parallel_degree ", degree(),
                     " does not divide the ", n_experts, " routed experts of ", fqn,
                     "; pick a divisor of ", n_experts);
  // The weights and, where the experts have them (GPT-OSS), the biases: each with its expert.
  for (const std::string& name : experts.stacked_parameter_names()) {
    nn::ParameterSlot& slot = experts.parameter_slot(name);
    LOOM_REQUIRE(!slot.layout, fqn, ".experts.", name, " is already sharded (", slot.layout->describe(),
                 "); expert parallelism shards whole expert stacks");
    tensor::TensorLayout layout;
    layout.global_shape = slot.tensor.sizes().vec();
    layout.placements = {{kMeshDim, tensor::Shard{0}, comm_->rank(), degree()}};
    const tensor::Box box = layout.local_box();
    torch::Tensor local;
    if (slot.tensor.is_meta()) {
      local = torch::empty(box.sizes, slot.tensor.options());
    } else {
      torch::NoGradGuard no_grad;
      local = slot.tensor.narrow(0, box.offsets[0], box.sizes[0]).clone();
    }
    experts.set_parameter(name, local);
    experts.parameter_slot(name).layout = layout;
    sharded_.insert(fqn + ".experts." + name);
  }
  tensor::CommPtr comm = comm_;
  moe.set_expert_compute([comm](moe::GroupedExperts& local, const torch::Tensor& rows, const torch::Tensor& counts) {
    // The all-to-all's split sizes are host numbers: the one host read of the counts per layer.
    const torch::Tensor host = counts.to(torch::kCPU, torch::kLong).contiguous();
    const std::vector<int64_t> sizes(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
    return dispatch_to_experts(local, rows, sizes, comm);
  });
}

int64_t dispatch_wire_bytes(const std::vector<std::vector<int64_t>>& counts, int rank, int64_t dim,
                            int64_t element_bytes) {
  const int p = static_cast<int>(counts.size());
  if (p <= 1) return 0;
  const int64_t n_experts = static_cast<int64_t>(counts[rank].size());
  const int64_t local = n_experts / p;
  int64_t sent = 0, returned = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    if (e / local != rank) sent += counts[rank][e];
  }
  for (int s = 0; s < p; ++s) {
    if (s == rank) continue;
    for (int64_t e = rank * local; e < (rank + 1) * local; ++e) returned += counts[s][e];
  }
  const int64_t counts_bytes = static_cast<int64_t>(sizeof(int64_t)) * (n_experts - local);
  return counts_bytes + 2 * (sent + returned) * dim * element_bytes;
}

torch::Tensor dispatch_to_experts(moe::GroupedExperts& experts, const torch::Tensor& rows,
                                  const std::vector<int64_t>& counts, const tensor::CommPtr& comm) {
  const int p = comm->size();
  const int64_t n_experts = static_cast<int64_t>(counts.size());
  LOOM_REQUIRE(n_experts % p == 0, "dispatch_to_experts: ", n_experts, " experts over ", p, " ranks");
  const int64_t local = n_experts / p;
  // (GroupedExperts::forward checks that it holds `local` experts: only there, inside FSDP's hooks,
  // are its parameters unsharded.)
  // 1. Counts: rank s learns received[s][j], the rows rank s sends for its local expert j.
  const torch::Tensor sent_counts = torch::tensor(counts, torch::kLong);
  torch::Tensor received_counts = torch::empty({n_experts}, torch::kLong);
  comm->all_to_all(received_counts, sent_counts);
  const int64_t* received = received_counts.data_ptr<int64_t>();
  std::vector<int64_t> send_splits(p, 0), recv_splits(p, 0), local_counts(local, 0);
  for (int64_t e = 0; e < n_experts; ++e) send_splits[e / local] += counts[e];
  for (int s = 0; s < p; ++s) {
    for (int64_t j = 0; j < local; ++j) {
      recv_splits[s] += received[s * local + j];
      local_counts[j] += received[s * local + j];
    }
  }
  // 2. Dispatch: rows arrive ordered (source rank, local expert).
  const torch::Tensor arrived = tensor::all_to_all_rows(rows, recv_splits, send_splits, comm);
  // 3. Regroup to (local expert, source rank): each expert's rows contiguous, in a fixed order.
  const int64_t total = arrived.size(0);
  std::vector<int64_t> source_offset(p * local);
  int64_t offset = 0;
  for (int s = 0; s < p; ++s) {
    for (int64_t j = 0; j < local; ++j) {
      source_offset[s * local + j] = offset;
      offset += received[s * local + j];
    }
  }
  torch::Tensor order = torch::empty({total}, torch::kLong);
  int64_t* o = order.data_ptr<int64_t>();
  int64_t at = 0;
  for (int64_t j = 0; j < local; ++j) {
    for (int s = 0; s < p; ++s) {
      for (int64_t i = 0; i < received[s * local + j]; ++i) o[at++] = source_offset[s * local + j] + i;
    }
  }
  torch::Tensor inverse = torch::empty({total}, torch::kLong);
  int64_t* inv = inverse.data_ptr<int64_t>();
  for (int64_t i = 0; i < total; ++i) inv[o[i]] = i;
  order = order.to(rows.device());
  inverse = inverse.to(rows.device());
  const torch::Tensor grouped = arrived.index_select(0, order);
  const torch::Tensor out = experts.forward(grouped, local_counts);
  // 4. Combine: back to arrival order, then to the ranks the rows came from.
  return tensor::all_to_all_rows(out.index_select(0, inverse), send_splits, recv_splits, comm);
}

}  // namespace loom::ep
