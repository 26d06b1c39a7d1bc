// Per-parameter initialization that does not depend on how parameters are laid out.
//
// Each parameter is drawn from its own CPU generator seeded by (seed, parameter name) over its
// full shape, in fp32, then cast into the destination. So a model initialized whole, sharded
// across ranks (each rank draws the full tensor and keeps its slice), or on another device starts
// from bitwise the same values.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace loom::nn {

struct ParameterInit {
  enum class Kind { kNormal, kTruncatedNormal, kOnes, kZeros, kKaimingUniform };
  Kind kind = Kind::kNormal;
  double mean = 0.0;
  double std = 1.0;
  double lower = -2.0;  // kTruncatedNormal: absolute cut-offs, as torch.nn.init.trunc_normal_
  double upper = 2.0;

  static ParameterInit normal(double std, double mean = 0.0) {
    return {Kind::kNormal, mean, std, 0.0, 0.0};
  }
  static ParameterInit truncated_normal(double std, double lower, double upper,
                                        double mean = 0.0) {
    return {Kind::kTruncatedNormal, mean, std, lower, upper};
  }
  static ParameterInit ones() { return {Kind::kOnes, 0.0, 0.0, 0.0, 0.0}; }
  static ParameterInit zeros() { return {Kind::kZeros, 0.0, 0.0, 0.0, 0.0}; }
  // torch.nn.init.kaiming_uniform_(a = sqrt(5)) of a 2-D [out, in] weight (nn.Linear's and PEFT's
  // lora_A default): U(-1/sqrt(in), 1/sqrt(in)).
  static ParameterInit kaiming_uniform() { return {Kind::kKaimingUniform, 0.0, 0.0, 0.0, 0.0}; }
};

// The generator seed of one parameter: a 64-bit mix of the run seed and the FNV-1a hash of its
// dotted name. Stable across platforms and releases (checkpoints rely on it).
uint64_t parameter_seed(uint64_t seed, std::string_view name);

// Fills `generator`-driven samples into a CPU fp32 tensor, in place. Truncated normal uses the
// inverse-CDF method of torch.nn.init.trunc_normal_ (uniform in CDF space, erfinv, clamp).
void normal_(torch::Tensor& cpu_fp32, double mean, double std, at::Generator generator);
void trunc_normal_(torch::Tensor& cpu_fp32, double mean, double std, double lower, double upper,
                   at::Generator generator);

// Draws the full value of parameter `name` (shape/dtype/device of `full`) and writes it into
// `full`. Meta tensors are rejected: materialize first (Module::to_empty).
void init_parameter(const ParameterInit& init, const std::string& name, uint64_t seed,
                    torch::Tensor& full);

}  // namespace loom::nn
