// Collective matmuls: async tensor parallelism's two fused ops (the "looped collective einsum" of
// Wang et al., TorchTitan's micro-pipelined async TP). With sequence parallelism every colwise
// projection starts with an all-gather of its input along the sequence and every rowwise one ends
// with a reduce-scatter of its output; done as one collective each, the matmul waits for the whole
// transfer. Here the transfer is a ring of point-to-point sends of one sequence chunk at a time,
// and each chunk's matmul runs while the next chunk travels:
//
//   all_gather_matmul(x, {W_i})     x Shard(seq) -> x Replicate and y_i = x @ W_i^T   (colwise)
//     step j: compute on the chunk that arrived last, while passing it on and receiving the next.
//   matmul_reduce_scatter(x, W)     y = x @ W^T, Partial -> Shard(seq)                 (rowwise)
//     step j: compute this rank's addend for the chunk the ring carries next, while the running
//     sum of the previous chunk travels; the sum for chunk r ends on rank r.
//
// The backward of each is the other: the input gradient of all_gather_matmul is a
// matmul_reduce_scatter of sum_i dy_i @ W_i (the weight gradients need the gathered input, which
// the forward kept), and the input gradient of matmul_reduce_scatter is an all_gather_matmul of
// dy with W. Each rank sends (t-1) chunks of 1/t of the tensor per op, so the bytes on the wire are
// those of the ring all-gather / reduce-scatter they replace; the Comm counts them as t-1 sends and
// t-1 receives on the group. The sums are the same terms, added in ring order and in per-chunk
// GEMMs, so results equal plain TP's within float32 rounding, not bitwise.
//
// Built on the Comm's async send/recv (c10d point-to-point), so it runs on Gloo here and on NCCL.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "loom/tensor/collectives.h"

namespace loom::tp {

struct GatheredMatmul {
  torch::Tensor input;                // the gathered input (autograd: its gradient is reduce-scattered)
  std::vector<torch::Tensor> outputs; // input @ weights[i]^T, in the order given
};

// `local`: this rank's chunk along `dim` (>= 0 or negative; not the last dim); `weights`: [out_i, in]
// linear weights (no bias). Every output has the gathered sequence length.
GatheredMatmul all_gather_matmul(const torch::Tensor& local, const std::vector<torch::Tensor>& weights,
                                 int64_t dim, const tensor::CommPtr& comm);

// `input`: the whole sequence with this rank's slice of the features; `weight`: [out, in_local].
// Returns this rank's chunk along `dim` of the sum over ranks of input @ weight^T.
torch::Tensor matmul_reduce_scatter(const torch::Tensor& input, const torch::Tensor& weight, int64_t dim,
                                    const tensor::CommPtr& comm);

}  // namespace loom::tp
