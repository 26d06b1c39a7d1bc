// Fused kernels for the Llama layers, each an autograd Function with a hand-written backward.
//
// Why: the plain libtorch compositions run one memory pass per elementwise op (at::rms_norm on CPU
// decomposes into pow / mean / add / rsqrt / mul forward and ~12 ops backward; RoPE is cat + mul +
// addcmul; cross-entropy over the vocabulary materialises the [tokens, vocab] logits, their
// log-softmax, a zero-filled gradient and its log-softmax backward). Each CPU kernel here makes one
// pass forward and one backward (parallelised with at::parallel_for), and saves only what its
// backward reads.
//
// Two implementations sit behind every entry point, and `fused_impl_for` alone picks one from the
// device and the compute dtype:
//   kCpuFp32  hand-written fp32 CPU kernels (raw pointers, SIMD loops);
//   kGeneric  ATen ops only, so it runs on any device and dtype: at::rms_norm (which itself takes
//             the fused _fused_rms_norm kernel with its own backward on CUDA), at::silu * up, the
//             RoPE composition, and a chunked linear + cross-entropy that, like the CPU kernel,
//             never materialises the [tokens, vocab] logits.
// Callers never branch; model code calls the same functions on every device. Results match the
// libtorch compositions to the rounding of the compute dtype (tests state tolerances).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace loom::nn {

enum class FusedImpl {
  kCpuFp32,  // hand-written CPU kernels; fp32 only
  kGeneric,  // ATen ops; any device, any floating dtype
  kCuda,     // Loom's CUDA kernels (nn/cuda/kernels.h); CUDA builds, fp32/bf16/fp16
};

// Loom's CUDA kernels, each of which can be switched off (falling back to its ATen composition):
// to measure what each one brings (bench/gpu_vs_pytorch.py --ablation), or to rule one out when
// chasing a numerical difference. Set once per process from `training.cuda_kernels`.
enum class CudaKernel : unsigned {
  kSwiGLU = 1u << 0,
  kRmsNorm = 1u << 1,
  kRope = 1u << 2,
  kCrossEntropy = 1u << 3,
  // Not an nn kernel: optim's AdamW update (optim/cuda/adamw_kernel.h), switched by the same key.
  kAdamW = 1u << 4,
  // The residual add fused into the following RMSNorm (fused_add_rms_norm).
  kAddRmsNorm = 1u << 5,
};
struct CudaKernelSet {
  unsigned bits = 0;
  bool has(CudaKernel k) const { return (bits & static_cast<unsigned>(k)) != 0; }
  static CudaKernelSet all() { return {0x3Fu}; }
  bool operator==(const CudaKernelSet&) const = default;
};
// "all", "none", or a comma-separated list of swiglu, rms_norm, rope, cross_entropy, adamw,
// add_rms_norm. Throws
// loom::UsageError naming the unknown entry and the accepted ones.
CudaKernelSet parse_cuda_kernels(const std::string& spec);
void set_cuda_kernels(CudaKernelSet kernels);
CudaKernelSet enabled_cuda_kernels();
// Whether this build has the kernels at all (libtorch with CUDA: LOOM_WITH_CUDA_KERNELS).
bool cuda_kernels_built();

// The one place that maps a device and the dtype an op computes in to an implementation: CPU +
// fp32 -> kCpuFp32; CUDA + fp32/bf16/fp16 in a build with the CUDA kernels -> kCuda (an op whose
// kernel `training.cuda_kernels` switched off runs kGeneric); everything else (other accelerators,
// fp64, CPU autocast) -> kGeneric. Every entry point below asks it unless the caller forces `impl`; an entry point
// whose inputs the CPU kernel cannot take (mixed dtypes, empty tensors, strided caches) runs
// kGeneric instead, or throws loom::Error when kCpuFp32 was forced.
//
// Why a function and not the libtorch dispatcher: the dispatcher keys on the backend (CPU, CUDA,
// Autograd, Autocast...), not on dtype, so registering loom:: ops would still leave a dtype branch
// inside the CPU kernel, and would take a CPU, a CUDA, an Autograd and an Autocast registration
// per op for what is a two-way choice. One function keeps the choice in sight and testable.
FusedImpl fused_impl_for(c10::Device device, c10::ScalarType compute_dtype);

// The dtype the output head's GEMMs run in, as at::linear would under the current autocast state:
// the autocast dtype when autocast is on for hidden's device type and both inputs are eligible
// floating-point tensors there (not fp64, as autocast), else promote_types(hidden, weight).
c10::ScalarType linear_compute_dtype(const torch::Tensor& hidden, const torch::Tensor& weight);

// x / sqrt(mean(x^2, -1) + eps) * weight over the last dimension. Saves x and one fp32 rstd per row.
// kGeneric: at::rms_norm (CUDA: the fused _fused_rms_norm kernel and its backward). kCuda: one
// kernel each way; under CUDA autocast it writes the autocast dtype directly (every consumer of a
// norm is a linear that would cast it there anyway), saving a pass.
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                             std::optional<FusedImpl> impl = std::nullopt);

// The residual add in front of a norm and the norm, as one op: returns (sum, fused_rms_norm(sum))
// with sum = residual + delta. kCuda (kernel add_rms_norm, when the residual's dtype is the wider
// one, as the fp32 residual stream + a bf16 block output under autocast): one kernel each way,
// the sum written and normalised in one pass, and the backward adds the sum's own gradient and
// writes the delta's in its dtype in the same pass. Every other case: residual + delta, then
// fused_rms_norm, exactly the unfused composition.
std::pair<torch::Tensor, torch::Tensor> fused_add_rms_norm(const torch::Tensor& residual,
                                                           const torch::Tensor& delta,
                                                           const torch::Tensor& weight, double eps,
                                                           std::optional<FusedImpl> impl = std::nullopt);

// Rotate-half RoPE (loom/nn/rope.h convention). x: [B, T, H, D]; cache: [2, >=T, D] fp32
// (cos, sign-folded sin). Saves nothing but the cache: the backward is the inverse rotation.
// kGeneric: (x * cos).addcmul_(swap_halves(x), sin) in x's dtype.
torch::Tensor fused_rotary_embedding(const torch::Tensor& x, const torch::Tensor& cache,
                                     std::optional<FusedImpl> impl = std::nullopt);

// silu(gate) * up. Saves gate and up (sigmoid is recomputed); the backward is one pass.
// kGeneric: at::silu(gate) * up (ATen has no fused SwiGLU; silu is one kernel with its own
// backward, so this is two passes forward instead of one).
torch::Tensor fused_swiglu(const torch::Tensor& gate, const torch::Tensor& up,
                           std::optional<FusedImpl> impl = std::nullopt);

// mean over non-ignored tokens of cross_entropy(hidden @ weight^T, labels), without materialising
// the [N, vocab] logits: tokens are processed `chunk_tokens` at a time (logits chunk -> logsumexp
// -> softmax - onehot -> the two gradient GEMMs), so the gradients of hidden and weight are
// computed in the forward and the backward only scales them by the incoming gradient. Extra memory
// is O(chunk_tokens * vocab) on every device and dtype.
// hidden: [N, dim], weight: [vocab, dim], labels: [N] int64 on hidden's device (ignore_index marks
// padding). Returns a 0-dim fp32 loss. When every label is ignored the loss is 0 and every gradient
// zero: such a micro-batch counts with zero weight (an SFT row whose prompt fills it, or a
// context-parallel chunk of prompt tokens), where PyTorch's cross_entropy gives nan, which would
// stop the run as a divergence. Throws
// loom::Error for out-of-range labels on the CPU; on an accelerator, where that check would be a
// host sync in the middle of the forward, an out-of-range label makes the loss nan instead (the
// trainer checks token ids on the host when it loads the data). Nothing here reads a device value
// on the host: the valid-token count stays on the device.
//
// kCuda: chunks of at least `chunk_tokens`, as large as fit in min(1 GiB, 1/8 of the allocatable
// device memory) of logits (at most 4096 rows); per chunk one GEMM writes the logits, one kernel
// turns them in place into the loss and scale * (softmax - onehot) (cuda/kernels.h), and the
// weight gradient is accumulated by a GEMM that writes fp32 directly.
//
// The GEMMs run in linear_compute_dtype(hidden, weight) -- under autocast that is the autocast
// dtype, exactly what autocast does for the at::linear this replaces (bf16 hidden and an fp32
// master weight compute in bf16) -- while the softmax math is fp32 and the weight gradient is
// accumulated over chunks in fp32. Gradients come back in each input's own dtype (an fp32 master
// weight gets an fp32 gradient).
torch::Tensor fused_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                         const torch::Tensor& labels, int64_t ignore_index = -100,
                                         int64_t chunk_tokens = 512,
                                         std::optional<FusedImpl> impl = std::nullopt);

}  // namespace loom::nn
