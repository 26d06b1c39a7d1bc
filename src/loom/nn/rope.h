// Rotary position embeddings (RoPE) with optional Llama 3.1 frequency scaling.
//
// Convention: "rotate-half" (the Hugging Face layout): a head vector's dimension i is paired with
// i + head_dim/2, not with its neighbour as in Meta's original interleaved layout. Using it
// natively means Hugging Face q/k weights load without permutation; Meta-layout weights would need
// the inverse of HF's conversion permutation.
//
// The cache is one tensor [2, max_seq_len, head_dim]: [0] = cos(p * f) with the half-frequencies
// repeated, [1] = sin(p * f) with its first half negated. With that sign folded in, rotating x is
//   x * cos + swap_halves(x) * sin_signed
// which is one fused pass over the [B, T, H, D] layout (loom/nn/fused.h), no complex arithmetic.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <optional>

namespace loom::nn {

// Llama 3.1's long-context rescaling of RoPE frequencies (Meta's apply_scaling): frequencies whose
// wavelength exceeds original_max_position / low_freq_factor are divided by `factor`, those below
// original_max_position / high_freq_factor are kept, and the band between is interpolated.
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

// fp32 [head_dim / 2]: theta^(-2i/head_dim), rescaled when `scaling` is set. Computed with fp32
// tensor ops in the same order as Hugging Face so both produce bitwise-equal frequencies.
torch::Tensor rope_inverse_frequencies(int64_t head_dim, double theta,
                                       const std::optional<RopeScaling>& scaling);

// YaRN (Peng et al. 2023) as transformers computes it (_compute_yarn_parameters): frequencies
// whose wavelength exceeds the correction range are interpolated (divided by `factor`), those below
// it kept, a linear ramp between; the range comes from beta_fast / beta_slow rotations over
// original_max_position, floored/ceiled unless `truncate` is false (GPT-OSS), clipped to
// [0, head_dim - 1]. DeepSeek-V3 and GPT-OSS use it.
struct YarnScaling {
  double factor = 1.0;
  int64_t original_max_position = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
};
// fp32 [head_dim / 2], in transformers' fp32 ops (bitwise-equal frequencies).
torch::Tensor yarn_inverse_frequencies(int64_t head_dim, double theta, const YarnScaling& scaling);
// YaRN's attention temperature 0.1 mscale ln(factor) + 1 (1 for factor <= 1): transformers'
// get_mscale, DeepSeek's yarn_get_mscale. The cos/sin cache is multiplied by
// yarn_mscale(factor, 1) (or DeepSeek's ratio of two) when no attention_factor is given.
double yarn_mscale(double factor, double mscale = 1.0);

// [2, max_seq_len, head_dim] fp32 cache (see above) for positions 0..max_seq_len-1.
torch::Tensor rope_cache(const torch::Tensor& inverse_frequencies, int64_t max_seq_len);

// x: [B, T, H, head_dim]; cache: [2, >=T, head_dim] (positions 0..T-1 are used). Returns a new
// contiguous [B, T, H, head_dim] tensor in x's dtype.
torch::Tensor apply_rotary_embedding(const torch::Tensor& x, const torch::Tensor& cache);

}  // namespace loom::nn
