// Fused CPU kernels for the Llama layers, each an autograd Function with a hand-written backward.
//
// Why: the plain libtorch compositions run one memory pass per elementwise op (at::rms_norm on CPU
// decomposes into pow / mean / add / rsqrt / mul forward and ~12 ops backward; RoPE is cat + mul +
// addcmul; cross-entropy over the vocabulary materialises the [tokens, vocab] logits, their
// log-softmax, a zero-filled gradient and its log-softmax backward). Each kernel here makes one
// pass forward and one backward (parallelised with at::parallel_for), and saves only what its
// backward reads.
//
// Fast paths are fp32 CPU tensors; other dtypes/devices fall back to the libtorch composition, so
// callers never branch. Results match the composition to fp32 rounding (tests state tolerances).
#pragma once
#include <torch/torch.h>

#include <cstdint>

namespace loom::nn {

// x / sqrt(mean(x^2, -1) + eps) * weight over the last dimension. Saves x and one fp32 rstd per row.
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// Rotate-half RoPE (loom/nn/rope.h convention). x: [B, T, H, D]; cache: [2, >=T, D] fp32
// (cos, sign-folded sin). Saves nothing but the cache: the backward is the inverse rotation.
torch::Tensor fused_rotary_embedding(const torch::Tensor& x, const torch::Tensor& cache);

// silu(gate) * up. Saves gate, up and sigmoid(gate); the backward is one pass.
torch::Tensor fused_swiglu(const torch::Tensor& gate, const torch::Tensor& up);

// mean over non-ignored tokens of cross_entropy(hidden @ weight^T, labels), without materialising
// the [N, vocab] logits: tokens are processed `chunk_tokens` at a time (logits chunk -> logsumexp
// -> softmax - onehot in place -> the two gradient GEMMs), so the gradients of hidden and weight
// are computed in the forward and the backward only scales them by the incoming gradient.
// hidden: [N, dim], weight: [vocab, dim], labels: [N] int64 (ignore_index marks padding).
// Returns a 0-dim loss in fp32. Throws loom::Error for out-of-range labels.
torch::Tensor fused_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                         const torch::Tensor& labels, int64_t ignore_index = -100,
                                         int64_t chunk_tokens = 512);

}  // namespace loom::nn
