#include "loom/nn/rope.h"

#include <cmath>

#include "loom/core/error.h"
#include "loom/nn/fused.h"

namespace loom::nn {

torch::Tensor rope_inverse_frequencies(int64_t head_dim, double theta,
                                       const std::optional<RopeScaling>& scaling) {
  LOOM_REQUIRE(head_dim > 0 && head_dim % 2 == 0, "RoPE needs an even head_dim, got ", head_dim);
  LOOM_REQUIRE(theta > 1.0, "RoPE theta must be > 1, got ", theta);
  torch::NoGradGuard no_grad;
  torch::Tensor exponents = torch::arange(0, head_dim, 2, torch::kInt64).to(torch::kFloat32) /
                            static_cast<double>(head_dim);
  torch::Tensor inv_freq = 1.0 / torch::pow(theta, exponents);
  if (!scaling) return inv_freq;

  const RopeScaling& s = *scaling;
  LOOM_REQUIRE(s.factor >= 1.0 && s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor &&
                   s.original_max_position > 0,
               "invalid Llama 3 RoPE scaling (factor ", s.factor, ", low_freq_factor ",
               s.low_freq_factor, ", high_freq_factor ", s.high_freq_factor,
               ", original_max_position ", s.original_max_position,
               "); need factor >= 1 and 0 < low_freq_factor < high_freq_factor");
  const double old_context = static_cast<double>(s.original_max_position);
  const double low_freq_wavelen = old_context / s.low_freq_factor;
  const double high_freq_wavelen = old_context / s.high_freq_factor;
  torch::Tensor wavelen = 2 * M_PI / inv_freq;
  torch::Tensor scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  torch::Tensor smooth = (old_context / wavelen - s.low_freq_factor) /
                         (s.high_freq_factor - s.low_freq_factor);
  torch::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  torch::Tensor is_medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return torch::where(is_medium, smoothed, scaled);
}

torch::Tensor yarn_inverse_frequencies(int64_t head_dim, double theta, const YarnScaling& s) {
  LOOM_REQUIRE(head_dim > 0 && head_dim % 2 == 0, "RoPE needs an even head_dim, got ", head_dim);
  LOOM_REQUIRE(theta > 1.0, "RoPE theta must be > 1, got ", theta);
  LOOM_REQUIRE(s.factor >= 1.0 && s.original_max_position > 0 && s.beta_fast > s.beta_slow && s.beta_slow > 0,
               "invalid YaRN RoPE scaling (factor ", s.factor, ", original_max_position ", s.original_max_position,
               ", beta_fast ", s.beta_fast, ", beta_slow ", s.beta_slow,
               "); need factor >= 1, original_max_position > 0 and beta_fast > beta_slow > 0");
  torch::NoGradGuard no_grad;
  const int64_t d = head_dim;
  const auto fp32 = torch::TensorOptions().dtype(torch::kFloat32);
  const torch::Tensor pos_freqs = torch::pow(theta, torch::arange(0, d, 2, torch::kInt64).to(torch::kFloat32) / d);
  const torch::Tensor extrapolation = 1.0 / pos_freqs;
  const torch::Tensor interpolation = 1.0 / (s.factor * pos_freqs);
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(d) *
            std::log(static_cast<double>(s.original_max_position) / (rotations * 2 * M_PI))) /
           (2 * std::log(theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(d - 1));
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  const torch::Tensor ramp = torch::clamp((torch::arange(d / 2, fp32) - low) / (high - low), 0, 1);
  const torch::Tensor extrapolation_factor = 1 - ramp;
  return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
}

double yarn_mscale(double factor, double mscale) { return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

torch::Tensor rope_cache(const torch::Tensor& inverse_frequencies, int64_t max_seq_len) {
  LOOM_REQUIRE(max_seq_len > 0, "RoPE cache needs max_seq_len > 0, got ", max_seq_len);
  torch::NoGradGuard no_grad;
  torch::Tensor positions = torch::arange(max_seq_len, torch::kInt64).to(torch::kFloat32);
  torch::Tensor angles = torch::outer(positions, inverse_frequencies.to(torch::kFloat32));
  torch::Tensor cos = angles.cos();
  torch::Tensor sin = angles.sin();
  return torch::stack({torch::cat({cos, cos}, -1), torch::cat({-sin, sin}, -1)});
}

torch::Tensor apply_rotary_embedding(const torch::Tensor& x, const torch::Tensor& cache) {
  TORCH_CHECK(x.dim() == 4, "apply_rotary_embedding expects [B, T, H, D], got ", x.sizes());
  const int64_t seq_len = x.size(1);
  const int64_t head_dim = x.size(3);
  TORCH_CHECK(cache.dim() == 3 && cache.size(0) == 2 && cache.size(2) == head_dim,
              "RoPE cache of shape ", cache.sizes(), " does not match head_dim ", head_dim);
  LOOM_REQUIRE(seq_len <= cache.size(1), "sequence length ", seq_len,
               " exceeds the RoPE cache (max_seq_len ", cache.size(1),
               "); raise the model's max_seq_len");
  // One pass forward and one backward (the inverse rotation); composite for non-fp32.
  return fused_rotary_embedding(x, cache);
}

}  // namespace loom::nn
