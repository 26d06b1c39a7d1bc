#include "loom/optim/adamw8bit.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_set>

#include "loom/core/error.h"

// This file is compiled with -ffp-contract=off (CMakeLists.txt): a fused multiply-add in one code
// path (vector body) and not in another (a block's scalar tail at another alignment) would make an
// element's update depend on where its block starts in memory, i.e. on the FSDP layout.

namespace loom::optim {
namespace {

// bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8),
// step by step in float32 as PyTorch computes it: linspace(0.1, 1, k) boundaries, their midpoints,
// scaled by 10^(i - 6) for exponent i = 0..6; then 0 and 1; sorted.
std::array<float, 256> make_dynamic_map(bool is_signed) {
  constexpr int kMaxExponentBits = 7;
  std::vector<float> data;
  for (int i = 0; i < kMaxExponentBits; ++i) {
    const int64_t items = (int64_t{1} << (is_signed ? i : i + 1)) + 1;
    // torch.linspace(0.1, 1, items) in float32: start + k*step in the first half, end - (n-1-k)*step
    // in the second (ATen's RangeFactories kernel), each rounded once as its vectorised kernel's
    // fused multiply-add does.
    const float start = 0.1f, end = 1.0f;
    const float step = (end - start) / static_cast<float>(items - 1);
    std::vector<float> boundaries(static_cast<size_t>(items));
    const int64_t halfway = items / 2;
    for (int64_t k = 0; k < items; ++k) {
      boundaries[k] = k < halfway ? std::fma(step, static_cast<float>(k), start)
                                  : std::fma(-step, static_cast<float>(items - k - 1), end);
    }
    const float scale = static_cast<float>(std::pow(10.0, i - (kMaxExponentBits - 1)));
    for (int64_t k = 0; k + 1 < items; ++k) {
      const float mean = (boundaries[k] + boundaries[k + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  TORCH_INTERNAL_ASSERT(data.size() == 256, "dynamic map has ", data.size(), " entries");
  std::sort(data.begin(), data.end());
  std::array<float, 256> out{};
  std::copy(data.begin(), data.end(), out.begin());
  return out;
}

// Scalars of one step, as at::_fused_adamw_ derives them (double, then float32 for the loop).
struct StepScalars {
  float decay_factor;  // 1 - lr * weight_decay
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;     // lr / (1 - beta1^t)
  float bias_correction2_sqrt;
  float eps;
};

StepScalars step_scalars(const AdamWOptions& o, double step, double weight_decay) {
  return {static_cast<float>(1.0 - o.lr * weight_decay),
          static_cast<float>(o.beta1),
          static_cast<float>(1.0 - o.beta1),
          static_cast<float>(o.beta2),
          static_cast<float>(1.0 - o.beta2),
          static_cast<float>(o.lr / (1.0 - std::pow(o.beta1, step))),
          static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, step))),
          static_cast<float>(o.eps)};
}

// AdamW on n elements with float32 moments m, v (updated in place).
inline void update(float* p, const float* g, float* m, float* v, int64_t n, const StepScalars& s,
                   bool decay) {
  for (int64_t i = 0; i < n; ++i) {
    float param = p[i];
    if (decay) param = param * s.decay_factor;
    const float grad = g[i];
    const float exp_avg = m[i] + s.one_minus_beta1 * (grad - m[i]);
    const float exp_avg_sq = v[i] * s.beta2 + s.one_minus_beta2 * grad * grad;
    const float denom = std::sqrt(exp_avg_sq) / s.bias_correction2_sqrt + s.eps;
    p[i] = param - s.step_size * exp_avg / denom;
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
  }
}

}  // namespace

const std::array<float, 256>& signed_dynamic_map() {
  static const std::array<float, 256> map = make_dynamic_map(true);
  return map;
}

const std::array<float, 256>& unsigned_dynamic_map() {
  static const std::array<float, 256> map = make_dynamic_map(false);
  return map;
}

uint8_t nearest_code(const std::array<float, 256>& map, float x) {
  const auto it = std::lower_bound(map.begin(), map.end(), x);
  if (it == map.begin()) return 0;
  if (it == map.end()) return 255;
  const auto hi = static_cast<int>(it - map.begin());
  // Ties go to the lower entry.
  return static_cast<uint8_t>(map[hi] - x < x - map[hi - 1] ? hi : hi - 1);
}

float quantize_block(const float* x, int64_t n, const std::array<float, 256>& map, uint8_t* codes) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::abs(x[i]));
  if (absmax == 0.0f) {
    const uint8_t zero = nearest_code(map, 0.0f);
    std::fill(codes, codes + n, zero);
    return absmax;
  }
  for (int64_t i = 0; i < n; ++i) codes[i] = nearest_code(map, x[i] / absmax);
  return absmax;
}

void dequantize_block(const uint8_t* codes, int64_t n, float absmax,
                      const std::array<float, 256>& map, float* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = map[codes[i]] * absmax;
}

bool is_block_quantized(int64_t numel, int64_t block_size) {
  return block_size >= 1 && numel >= kMinQuantizedNumel && numel % block_size == 0;
}

AdamW8bitState AdamW8bitState::zeros(c10::IntArrayRef shape, bool quantized, int64_t block_size,
                                     const at::TensorOptions& options) {
  LOOM_REQUIRE(block_size >= 1, "AdamW8bit block_size must be >= 1, got ", block_size);
  AdamW8bitState s;
  s.quantized = quantized;
  s.block_size = block_size;
  if (!quantized) {
    s.exp_avg = at::zeros(shape, options.dtype(at::kFloat));
    s.exp_avg_sq = at::zeros(shape, options.dtype(at::kFloat));
    return s;
  }
  const int64_t numel = c10::multiply_integers(shape);
  LOOM_REQUIRE(numel % block_size == 0, "AdamW8bit: ", numel, " elements are not whole blocks of ",
               block_size);
  // Codes of 0 (any code reads as 0 while absmax is 0; these also requantize to themselves).
  const auto signed_zero = static_cast<int8_t>(nearest_code(signed_dynamic_map(), 0.0f) - 128);
  s.exp_avg = at::full(shape, signed_zero, options.dtype(at::kChar));
  s.exp_avg_sq = at::full(shape, nearest_code(unsigned_dynamic_map(), 0.0f), options.dtype(at::kByte));
  s.exp_avg_absmax = at::zeros({numel / block_size}, options.dtype(at::kFloat));
  s.exp_avg_sq_absmax = at::zeros({numel / block_size}, options.dtype(at::kFloat));
  return s;
}

int64_t AdamW8bitState::nbytes() const {
  int64_t bytes = 0;
  for (const at::Tensor* t : {&exp_avg, &exp_avg_sq, &exp_avg_absmax, &exp_avg_sq_absmax}) {
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  return bytes;
}

void adamw8bit_step(const std::vector<AdamW8bitPiece>& pieces, const AdamWOptions& options,
                    double step, int64_t block_size) {
  check_adamw_options(options, "AdamW8bit");
  LOOM_REQUIRE(block_size >= 1, "AdamW8bit block_size must be >= 1, got ", block_size);
  struct Work {
    float* p;
    const float* g;
    AdamW8bitState* state;
    StepScalars scalars;
    bool decay;
    int64_t numel;
  };
  std::vector<Work> work;
  std::vector<at::Tensor> keep_alive;  // contiguous gradient copies
  std::vector<int64_t> first_block{0};  // prefix sums of blocks per piece
  for (const AdamW8bitPiece& piece : pieces) {
    AdamW8bitState& s = *piece.state;
    const at::Tensor& p = piece.param;
    LOOM_REQUIRE(p.scalar_type() == at::kFloat && p.is_contiguous() && p.device().is_cpu(),
                 "AdamW8bit updates contiguous float32 CPU parameters (master weights), got ",
                 p.scalar_type(), " on ", p.device());
    LOOM_REQUIRE(piece.grad.numel() == p.numel() && piece.grad.scalar_type() == at::kFloat,
                 "AdamW8bit: gradient of ", piece.grad.numel(), " ", piece.grad.scalar_type(),
                 " elements for a parameter of ", p.numel(), " float32");
    LOOM_REQUIRE(s.exp_avg.numel() == p.numel() && s.block_size == block_size,
                 "AdamW8bit state of ", s.exp_avg.numel(), " elements (block ", s.block_size,
                 ") for a parameter of ", p.numel(), " (block ", block_size, ")");
    if (p.numel() == 0) continue;
    at::Tensor g = piece.grad.contiguous();
    keep_alive.push_back(g);
    work.push_back({p.data_ptr<float>(), g.data_ptr<float>(), &s,
                    step_scalars(options, step, piece.weight_decay), piece.weight_decay != 0.0,
                    p.numel()});
    first_block.push_back(first_block.back() + (p.numel() + block_size - 1) / block_size);
  }
  const std::array<float, 256>& smap = signed_dynamic_map();
  const std::array<float, 256>& umap = unsigned_dynamic_map();
  // One loop over every block of every piece; each block reads and writes only its own elements,
  // so the split over threads does not change any result.
  at::parallel_for(0, first_block.back(), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> m(static_cast<size_t>(block_size)), v(static_cast<size_t>(block_size));
    for (int64_t b = begin; b < end; ++b) {
      const auto k = static_cast<size_t>(
          std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin() - 1);
      const Work& w = work[k];
      const int64_t block = b - first_block[k];
      const int64_t offset = block * block_size;
      const int64_t n = std::min(block_size, w.numel - offset);
      AdamW8bitState& s = *w.state;
      if (!s.quantized) {
        update(w.p + offset, w.g + offset, s.exp_avg.data_ptr<float>() + offset,
               s.exp_avg_sq.data_ptr<float>() + offset, n, w.scalars, w.decay);
        continue;
      }
      auto* m_codes = reinterpret_cast<uint8_t*>(s.exp_avg.data_ptr<int8_t>()) + offset;
      uint8_t* v_codes = s.exp_avg_sq.data_ptr<uint8_t>() + offset;
      float& m_absmax = s.exp_avg_absmax.data_ptr<float>()[block];
      float& v_absmax = s.exp_avg_sq_absmax.data_ptr<float>()[block];
      // int8 code c is map index c + 128: as bytes, flipping the sign bit turns one into the other.
      for (int64_t i = 0; i < n; ++i) m[i] = smap[m_codes[i] ^ 0x80u] * m_absmax;
      dequantize_block(v_codes, n, v_absmax, umap, v.data());
      update(w.p + offset, w.g + offset, m.data(), v.data(), n, w.scalars, w.decay);
      m_absmax = quantize_block(m.data(), n, smap, m_codes);
      for (int64_t i = 0; i < n; ++i) m_codes[i] ^= 0x80u;
      v_absmax = quantize_block(v.data(), n, umap, v_codes);
    }
  });
}

AdamW8bit::AdamW8bit(std::vector<ParamGroup> groups, AdamWOptions options, int64_t block_size)
    : options_(options), block_size_(block_size) {
  check_adamw_options(options_, "AdamW8bit");
  LOOM_REQUIRE_USAGE(block_size_ >= 1, "AdamW8bit block_size must be >= 1, got ", block_size_);
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const ParamGroup& group : groups) {
    LOOM_REQUIRE(group.param_names.size() == group.params.size(), "parameter group '", group.name,
                 "' has ", group.param_names.size(), " names for ", group.params.size(),
                 " parameters");
    LOOM_REQUIRE(group.weight_decay >= 0.0, "weight decay of parameter group '", group.name,
                 "' must be >= 0, got ", group.weight_decay);
    for (size_t i = 0; i < group.params.size(); ++i) {
      const std::string& name = group.param_names[i];
      const at::Tensor& p = group.params[i];
      LOOM_REQUIRE(p.defined() && p.scalar_type() == at::kFloat && p.is_contiguous(),
                   "parameter '", name, "' must be a defined contiguous float32 tensor for AdamW8bit");
      LOOM_REQUIRE(index_.emplace(name, slots_.size()).second, "parameter name '", name,
                   "' appears more than once in the optimizer's parameter groups");
      LOOM_REQUIRE(seen.insert(p.unsafeGetTensorImpl()).second, "parameter '", name,
                   "' is the same tensor as another parameter in the optimizer");
      slots_.push_back({name, p, at::zeros({}, p.options().dtype(at::kFloat)),
                        AdamW8bitState::zeros(p.sizes(), is_block_quantized(p.numel(), block_size_),
                                              block_size_, p.options()),
                        group.weight_decay});
    }
  }
}

void AdamW8bit::step() {
  at::NoGradGuard no_grad;
  // Parameters share one step count per step call; each keeps its own (a parameter without a
  // gradient keeps its count, as in AdamW).
  std::map<double, std::vector<AdamW8bitPiece>> by_step;
  for (Slot& s : slots_) {
    const at::Tensor& grad = s.param.grad();
    if (!grad.defined()) continue;
    LOOM_REQUIRE(grad.sizes() == s.param.sizes(), "gradient of '", s.name, "' has shape ",
                 grad.sizes(), " but the parameter has shape ", s.param.sizes());
    s.step.add_(1.0);
    by_step[s.step.item<double>()].push_back(
        {s.param.view(-1), grad.reshape(-1), &s.state, s.weight_decay});
  }
  for (const auto& [step, pieces] : by_step) adamw8bit_step(pieces, options_, step, block_size_);
}

void AdamW8bit::zero_grad(bool set_to_none) {
  for (Slot& s : slots_) zero_gradient(s.param, set_to_none);
}

void add_adamw8bit_state(TensorDict& out, const std::string& prefix, const AdamW8bitState& state,
                         c10::IntArrayRef param_shape) {
  out[prefix + ".exp_avg"] = state.exp_avg.view(param_shape);
  out[prefix + ".exp_avg_sq"] = state.exp_avg_sq.view(param_shape);
  if (state.quantized) {
    out[prefix + ".exp_avg.absmax"] = state.exp_avg_absmax;
    out[prefix + ".exp_avg_sq.absmax"] = state.exp_avg_sq_absmax;
  }
}

TensorDict AdamW8bit::state_dict() const {
  TensorDict out;
  for (const Slot& s : slots_) {
    out[s.name + ".step"] = s.step;
    add_adamw8bit_state(out, s.name, s.state, s.param.sizes());
  }
  return out;
}

void AdamW8bit::load_state_dict(const TensorDict& state) {
  load_state_in_place(state_dict(), state, "AdamW8bit");
}

int64_t AdamW8bit::state_nbytes() const {
  int64_t bytes = 0;
  for (const Slot& s : slots_) bytes += s.state.nbytes();
  return bytes;
}

const AdamW8bitState& AdamW8bit::state(const std::string& param_name) const {
  auto it = index_.find(param_name);
  LOOM_REQUIRE(it != index_.end(), "the optimizer has no parameter named '", param_name, "'");
  return slots_[it->second].state;
}

}  // namespace loom::optim
