#include "loom/nn/init.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "loom/core/error.h"

namespace loom::nn {
namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t fnv1a64(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

double normal_cdf(double x) { return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))); }
}  // namespace

uint64_t parameter_seed(uint64_t seed, std::string_view name) {
  return splitmix64(splitmix64(seed) ^ fnv1a64(name));
}

void normal_(torch::Tensor& cpu_fp32, double mean, double std, at::Generator generator) {
  cpu_fp32.normal_(mean, std, generator);
}

void trunc_normal_(torch::Tensor& cpu_fp32, double mean, double std, double lower, double upper,
                   at::Generator generator) {
  TORCH_CHECK(std > 0 && lower < upper, "trunc_normal_ needs std > 0 and lower < upper");
  const double lo = normal_cdf((lower - mean) / std);
  const double hi = normal_cdf((upper - mean) / std);
  cpu_fp32.uniform_(2 * lo - 1, 2 * hi - 1, generator);
  cpu_fp32.erfinv_();
  cpu_fp32.mul_(std * std::sqrt(2.0));
  cpu_fp32.add_(mean);
  cpu_fp32.clamp_(lower, upper);
}

void init_parameter(const ParameterInit& init, const std::string& name, uint64_t seed,
                    torch::Tensor& full) {
  LOOM_REQUIRE(!full.is_meta(), "cannot initialize parameter '", name,
               "' on the meta device; materialize the model first (Module::to_empty)");
  torch::NoGradGuard no_grad;
  switch (init.kind) {
    case ParameterInit::Kind::kOnes:
      full.fill_(1.0);
      return;
    case ParameterInit::Kind::kZeros:
      full.zero_();
      return;
    case ParameterInit::Kind::kNormal:
    case ParameterInit::Kind::kTruncatedNormal:
    case ParameterInit::Kind::kKaimingUniform:
      break;
  }
  // Sample on the CPU in fp32 whatever the destination, so values do not depend on it.
  const bool in_place = full.device().is_cpu() && full.scalar_type() == torch::kFloat32 &&
                        full.is_contiguous();
  torch::Tensor values = in_place ? full : torch::empty(full.sizes(), torch::kFloat32);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(parameter_seed(seed, name));
  if (init.kind == ParameterInit::Kind::kNormal) {
    normal_(values, init.mean, init.std, generator);
  } else if (init.kind == ParameterInit::Kind::kKaimingUniform) {
    LOOM_REQUIRE(full.dim() == 2 && full.size(1) > 0, "kaiming-uniform initialization of '", name,
                 "' needs a 2-D [out, in] tensor, got ", full.sizes());
    const double bound = 1.0 / std::sqrt(static_cast<double>(full.size(1)));
    values.uniform_(-bound, bound, generator);
  } else {
    trunc_normal_(values, init.mean, init.std, init.lower, init.upper, generator);
  }
  if (!in_place) full.copy_(values);
}

}  // namespace loom::nn
