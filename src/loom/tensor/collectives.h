// Collectives that autograd differentiates, over one mesh dimension (one dist::Comm): the pieces
// tensor and sequence parallelism are built from (Megatron-LM's f and g operators, DTensor's
// redistribute, written out). Each forward moves a tensor between placements (tensor/placement.h)
// and its backward moves the gradient the opposite way:
//
//   forward                               placements               backward
//   all_gather(x, d)                      Shard(d)   -> Replicate  reduce-scatter along d
//   reduce_scatter(x, d)                  Partial    -> Shard(d)   all-gather along d
//   all_reduce(x)                         Partial    -> Replicate  identity
//   all_reduce_in_backward(x)             Replicate  -> Replicate  all-reduce (inputs whose users
//                                                                  differ per rank, e.g. a colwise
//                                                                  linear's input without SP)
//   scatter(x, d)                         Replicate  -> Shard(d)   all-gather along d
//   all_to_all(x, from, to)               Shard(from)-> Shard(to)  all-to-all back
//
// A Replicate input whose consumers differ per rank receives, per rank, only its own consumers'
// share of the gradient; the ops above are placed so that every gradient leaving them is complete
// (that is why all_gather's backward reduce-scatters). Sharded dims must divide evenly. A group of
// one rank makes every op the identity. Tensors stay on their device; the Comm's backend must
// accept it (Gloo: CPU).
#pragma once
#include <torch/torch.h>

#include <memory>

#include "loom/dist/comm.h"
#include "loom/tensor/placement.h"

namespace loom::tensor {

using CommPtr = std::shared_ptr<dist::Comm>;

torch::Tensor all_gather(const torch::Tensor& local, int64_t dim, const CommPtr& comm);
torch::Tensor reduce_scatter(const torch::Tensor& partial, int64_t dim, const CommPtr& comm);
torch::Tensor all_reduce(const torch::Tensor& partial, const CommPtr& comm);
torch::Tensor all_reduce_in_backward(const torch::Tensor& replicated, const CommPtr& comm);
torch::Tensor scatter(const torch::Tensor& replicated, int64_t dim, const CommPtr& comm);
torch::Tensor all_to_all(const torch::Tensor& local, int64_t from_dim, int64_t to_dim,
                         const CommPtr& comm);

// Moves `local` (this rank's piece under `from`) to its piece under `to` with the ops above.
// Supported: any placement to itself (identity), Shard -> Replicate, Shard -> Shard, Partial ->
// Replicate, Partial -> Shard, Replicate -> Shard. Anything else is a loom::Error naming the pair.
torch::Tensor redistribute(const torch::Tensor& local, const Placement& from, const Placement& to,
                           const CommPtr& comm);

// The same movements without autograd, on plain tensors (the gradient paths above use them).
namespace raw {
torch::Tensor gather(const torch::Tensor& local, int64_t dim, dist::Comm& comm);
torch::Tensor reduce_scatter(const torch::Tensor& partial, int64_t dim, dist::Comm& comm);
torch::Tensor sum(const torch::Tensor& partial, dist::Comm& comm);  // a new tensor
torch::Tensor chunk(const torch::Tensor& replicated, int64_t dim, const dist::Comm& comm);
torch::Tensor all_to_all(const torch::Tensor& local, int64_t from_dim, int64_t to_dim, dist::Comm& comm);
}  // namespace raw

}  // namespace loom::tensor
