// Collectives that autograd differentiates, over one mesh dimension (one distributed::Comm): the pieces
// tensor and sequence parallelism are built from (Megatron-LM's f and g operators, DTensor's
// redistribute, written out). Each forward moves a tensor between placements (tensor/placement.h)
// and its backward moves the gradient the opposite way:
//
//   forward                               placements               backward
//   all_gather(x, d, kPartial)            Shard(d)   -> Replicate  reduce-scatter along d
//   all_gather(x, d, kIdentical)          Shard(d)   -> Replicate  this rank's piece of the grad
//   reduce_scatter(x, d)                  Partial    -> Shard(d)   all-gather along d
//   all_reduce(x)                         Partial    -> Replicate  identity
//   all_reduce_in_backward(x)             Replicate  -> Replicate  all-reduce (inputs whose users
//                                                                  differ per rank, e.g. a colwise
//                                                                  linear's input without SP)
//   scatter(x, d)                         Replicate  -> Shard(d)   all-gather along d
//   all_to_all(x, from, to)               Shard(from)-> Shard(to)  all-to-all back
//   all_to_all_rows(x, out, in)           rows to their ranks      rows back (splits swapped)
//
// A Replicate tensor whose consumers differ per rank (a colwise linear's sharded weight after it)
// receives, per rank, only its own consumers' share of the gradient: all_gather's backward must
// then sum the ranks' gradients (kPartial, Megatron's gather with tensor_parallel_output_grad).
// When every rank computes the same from it (gathered logits into a replicated loss) each rank's
// gradient is already whole, and summing would count it t times (kIdentical: DTensor's default).
// Sharded dims must divide evenly. A group of one rank makes every op the identity. Tensors stay on
// their device; the Comm's backend must accept it (Gloo: CPU).
#pragma once
#include <torch/torch.h>

#include <memory>

#include "loom/distributed/comm.h"
#include "loom/tensor/placement.h"

namespace loom::tensor {

using CommPtr = std::shared_ptr<distributed::Comm>;

// How the gradient of a gathered (Replicate) tensor arrives on the ranks; see above.
enum class ReplicatedGrad { kPartial, kIdentical };

torch::Tensor all_gather(const torch::Tensor& local, int64_t dim, const CommPtr& comm,
                         ReplicatedGrad grad);
torch::Tensor reduce_scatter(const torch::Tensor& partial, int64_t dim, const CommPtr& comm);
torch::Tensor all_reduce(const torch::Tensor& partial, const CommPtr& comm);
torch::Tensor all_reduce_in_backward(const torch::Tensor& replicated, const CommPtr& comm);
torch::Tensor scatter(const torch::Tensor& replicated, int64_t dim, const CommPtr& comm);
torch::Tensor all_to_all(const torch::Tensor& local, int64_t from_dim, int64_t to_dim,
                         const CommPtr& comm);

// Token dispatch (expert parallelism): this rank's rows [offset_j, offset_j + input_splits[j]) go
// to group rank j; the result holds, in source-rank order, output_splits[s] rows from rank s. Every
// rank's output_splits must be what the others send it (exchanged beforehand). The backward sends
// each gradient row back to the rank its row came from. Any split may be 0, as may the whole input.
torch::Tensor all_to_all_rows(const torch::Tensor& rows, const std::vector<int64_t>& output_splits,
                              const std::vector<int64_t>& input_splits, const CommPtr& comm);

// Moves `local` (this rank's piece under `from`) to its piece under `to` with the ops above.
// Supported: any placement to itself (identity), Shard -> Replicate (gradient as `grad` says),
// Shard -> Shard, Partial -> Replicate, Partial -> Shard, Replicate -> Shard. Anything else is a
// loom::Error naming the pair.
torch::Tensor redistribute(const torch::Tensor& local, const Placement& from, const Placement& to,
                           const CommPtr& comm, ReplicatedGrad grad = ReplicatedGrad::kIdentical);

// For autograd functions built on these (tp/collective_matmul.h): keeps `comm` with the node
// (under saved_data["comm"]) for its backward.
void save_comm(torch::autograd::AutogradContext* ctx, const CommPtr& comm);
distributed::Comm& saved_comm(torch::autograd::AutogradContext* ctx);

// The same movements without autograd, on plain tensors (the gradient paths above use them).
namespace raw {
torch::Tensor gather(const torch::Tensor& local, int64_t dim, distributed::Comm& comm);
torch::Tensor reduce_scatter(const torch::Tensor& partial, int64_t dim, distributed::Comm& comm);
torch::Tensor sum(const torch::Tensor& partial, distributed::Comm& comm);  // a new tensor
torch::Tensor chunk(const torch::Tensor& replicated, int64_t dim, const distributed::Comm& comm);
torch::Tensor all_to_all(const torch::Tensor& local, int64_t from_dim, int64_t to_dim, distributed::Comm& comm);
}  // namespace raw

}  // namespace loom::tensor
