#include "loom/float8/float8.h"

#include <ATen/autocast_mode.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/core/strings.h"
#ifdef LOOM_WITH_CUDA_FLOAT8_KERNELS
#include "loom/float8/cuda/quantize.h"
#endif

namespace loom::float8 {
namespace {

// torchao's EPS for amax: a zero (or denormal) row gets a large but finite scale.
constexpr double kAmaxFloor = 1e-12;

// The dtypes of the recipe's operands: inputs and weights always e4m3 (precision); gradients
// e4m3 in rowwise (torchao's ROWWISE recipe), e5m2 in tensorwise (range).
c10::ScalarType grad_dtype(Recipe recipe) {
  return recipe == Recipe::kRowwise ? torch::kFloat8_e4m3fn : torch::kFloat8_e5m2;
}

// The dtype of a linear's output: the input's, or under autocast (mixed precision without FSDP)
// the autocast dtype, as at::linear would return.
c10::ScalarType output_dtype(const torch::Tensor& x) {
  const auto type = x.device().type();
  if (at::autocast::is_autocast_enabled(type)) return at::autocast::get_autocast_dtype(type);
  return x.scalar_type();
}

using CommPtr = std::shared_ptr<distributed::Comm>;

// The group an operand's amax is reduced over: rowwise scales cover the contracted dim only,
// tensorwise ones the whole tensor (either of its dims sharded).
CommPtr amax_group(Recipe recipe, const CommPtr& contracted, const CommPtr& other) {
  if (recipe == Recipe::kRowwise) return contracted;
  return contracted ? contracted : other;
}

// The sharding travels from forward to backward in the context (an IValue capsule).
struct ShardingHolder : torch::CustomClassHolder {
  explicit ShardingHolder(Float8Sharding s) : sharding(std::move(s)) {}
  Float8Sharding sharding;
};

struct Float8Linear : torch::autograd::Function<Float8Linear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, int64_t recipe_id, const Float8Sharding& sharding) {
    const auto recipe = static_cast<Recipe>(recipe_id);
    const c10::ScalarType out_dtype = output_dtype(x);
    // The emulation's float32 ops must not be autocast to bfloat16: the GEMM's precision is the
    // recipe's, and its result is cast to the autocast dtype at the end.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    ctx->save_for_backward({x, weight});
    ctx->saved_data["recipe"] = recipe_id;
    if (sharding.any()) {
      ctx->saved_data["sharding"] = c10::IValue::make_capsule(c10::make_intrusive<ShardingHolder>(sharding));
    }
    const torch::Tensor x2 = x.reshape({-1, x.size(-1)});
    // Contracted over in: x [tokens, in] (tokens whole), W [out, in].
    const Float8Operand a = quantize(x2, torch::kFloat8_e4m3fn, recipe, amax_group(recipe, sharding.in_features, nullptr));
    const Float8Operand b = quantize(weight, torch::kFloat8_e4m3fn, recipe,
                                     amax_group(recipe, sharding.in_features, sharding.out_features));
    torch::Tensor y = scaled_mm_nt(a, b, out_dtype);
    auto shape = x.sizes().vec();
    shape.back() = weight.size(0);
    return y.view(shape);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& weight = saved[1];
    const auto recipe = static_cast<Recipe>(ctx->saved_data["recipe"].toInt());
    Float8Sharding sharding;
    if (const auto it = ctx->saved_data.find("sharding"); it != ctx->saved_data.end()) {
      sharding = c10::static_intrusive_pointer_cast<ShardingHolder>(it->second.toCapsule())->sharding;
    }
    const CommPtr& in = sharding.in_features;
    const CommPtr& out = sharding.out_features;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const torch::Tensor dy = grads[0].reshape({-1, weight.size(0)});   // [tokens, out]
    const torch::Tensor x2 = x.reshape({-1, x.size(-1)});               // [tokens, in]
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      // dx = dy W: dy along out (per token), W along out (per input feature).
      const Float8Operand a = quantize(dy, grad_dtype(recipe), recipe, amax_group(recipe, out, nullptr));
      const Float8Operand b = quantize(weight.t(), torch::kFloat8_e4m3fn, recipe, amax_group(recipe, out, in));
      dx = scaled_mm_nt(a, b, x.scalar_type()).view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      // dW = dy^T x: both along tokens (dy per output feature, x per input feature).
      // Contracted over the tokens, which TP never splits here (sequence parallelism gathers
      // them before a colwise linear and after a rowwise one).
      const Float8Operand a = quantize(dy.t(), grad_dtype(recipe), recipe, amax_group(recipe, nullptr, out));
      const Float8Operand b = quantize(x2.t(), torch::kFloat8_e4m3fn, recipe, amax_group(recipe, nullptr, in));
      dw = scaled_mm_nt(a, b, weight.scalar_type());
    }
    return {dx, dw, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

const options::EnumNames<Recipe>& option_names(Recipe) {
  static const options::EnumNames<Recipe> names = {{"rowwise", Recipe::kRowwise}, {"tensorwise", Recipe::kTensorwise}};
  return names;
}

double float8_max(c10::ScalarType dtype) {
  if (dtype == torch::kFloat8_e4m3fn) return 448.0;
  if (dtype == torch::kFloat8_e5m2) return 57344.0;
  fail("float8_max: ", dtype, " is not a float8 dtype Loom uses");
}

torch::Tensor Float8Operand::dequantize() const { return data.to(torch::kFloat32) / scale; }

#ifdef LOOM_WITH_CUDA_FLOAT8_KERNELS
namespace {

// The kernels' path: t row-major, or t^T row-major (the backward's W^T, dy^T and x^T), read once
// for the amax and once for the cast, which writes t's float8 rows contiguous. Returns false when
// t is neither (the caller then runs the ATen composition).
bool quantize_on_cuda(const torch::Tensor& t, c10::ScalarType dtype, Recipe recipe, const CommPtr& amax_group,
                      Float8Operand& result) {
  if (!t.is_cuda() || !at::isFloatingType(t.scalar_type()) || t.element_size() > 4) return false;
  const bool transposed = !t.is_contiguous() && t.t().is_contiguous();
  if (!transposed && !t.is_contiguous()) return false;
  const torch::Tensor base = transposed ? t.t() : t;  // row-major; t's rows are its columns when transposed
  const bool rowwise = recipe == Recipe::kRowwise;
  torch::Tensor amax = cuda::abs_max(base, /*per_column=*/transposed);
  if (!rowwise) amax = amax.numel() > 0 ? amax.max().reshape({1}) : torch::zeros({1}, amax.options());
  // A piece of a sharded tensor: the whole tensor's amax (max is exact in any order).
  if (amax_group != nullptr && amax_group->size() > 1) amax_group->all_reduce(amax, distributed::ReduceOp::kMax);
  auto [data, scale, inverse] =
      cuda::quantize(base, amax, transposed, /*per_tensor=*/!rowwise, dtype, float8_max(dtype), /*pow2=*/rowwise);
  if (rowwise) {
    result = {data, scale.view({-1, 1}), inverse.view({-1, 1})};
  } else {
    result = {data, scale.reshape({}), inverse.reshape({})};
  }
  return true;
}

}  // namespace
#endif

Float8Operand quantize(const torch::Tensor& t, c10::ScalarType dtype, Recipe recipe,
                       const std::shared_ptr<distributed::Comm>& amax_group) {
  LOOM_REQUIRE(t.dim() == 2, "float8::quantize takes a 2-D operand, got ", t.sizes());
#ifdef LOOM_WITH_CUDA_FLOAT8_KERNELS
  if (Float8Operand result; quantize_on_cuda(t, dtype, recipe, amax_group, result)) return result;
#endif
  return quantize_composed(t, dtype, recipe, amax_group);
}

Float8Operand quantize_composed(const torch::Tensor& t, c10::ScalarType dtype, Recipe recipe,
                                const std::shared_ptr<distributed::Comm>& amax_group) {
  LOOM_REQUIRE(t.dim() == 2, "float8::quantize takes a 2-D operand, got ", t.sizes());
  const double fmax = float8_max(dtype);
  const torch::Tensor hp = t.to(torch::kFloat32);
  // amax in float64 as torchao computes the scale (fmax / amax does not round before the cast).
  torch::Tensor amax = recipe == Recipe::kRowwise ? hp.abs().amax(/*dim=*/{1}, /*keepdim=*/true)
                                                  : hp.abs().max().reshape({1});
  // A piece of a sharded tensor: the whole tensor's amax (max is exact in any order).
  if (amax_group != nullptr && amax_group->size() > 1) amax_group->all_reduce(amax, distributed::ReduceOp::kMax);
  if (recipe == Recipe::kTensorwise) amax = amax.reshape({});
  torch::Tensor scale = (fmax / amax.to(torch::kFloat64).clamp_min(kAmaxFloor)).to(torch::kFloat32);
  // Rowwise: round down to a power of 2 (torchao's round_scales_to_power_of_2): multiplying and
  // dividing by it is exact, and rounding down keeps amax * scale <= fmax.
  if (recipe == Recipe::kRowwise) scale = torch::exp2(torch::floor(torch::log2(scale)));
  // The clamp is saturation: a value that still lands beyond fmax (tensorwise rounding) becomes
  // +-fmax, never inf or NaN (float8_e4m3fn has no inf; an overflowing cast would give NaN).
  const torch::Tensor data = (hp * scale).clamp(-fmax, fmax).to(dtype);
  return {data, scale};
}

torch::Tensor scaled_mm_nt(const Float8Operand& a, const Float8Operand& b, c10::ScalarType out_dtype) {
  LOOM_REQUIRE(a.data.size(1) == b.data.size(1), "scaled_mm_nt: contracted dims differ, ", a.data.sizes(),
               " and ", b.data.sizes());
  if (a.data.is_cuda()) {
    // _scaled_mm computes (A * scale_a) (B * scale_b) with dequantizing scales, A row-major and B
    // column-major: B^T of a row-major [N, K] is exactly that. Rowwise wants float32 [M, 1] and
    // [1, N] scales and a bfloat16 output; tensorwise takes 0-dim scales.
    const bool rowwise = a.scale.dim() > 0;
    const torch::Tensor inv_a = a.inverse_scale.defined() ? a.inverse_scale : a.scale.reciprocal();
    const torch::Tensor inv_b = b.inverse_scale.defined() ? b.inverse_scale : b.scale.reciprocal();
    const torch::Tensor scale_a = inv_a;
    const torch::Tensor scale_b = rowwise ? inv_b.view({1, -1}) : inv_b;
    const auto mm_dtype = rowwise ? torch::kBFloat16 : torch::kFloat32;
    return at::_scaled_mm(a.data.contiguous(), b.data.contiguous().t(), scale_a.contiguous(), scale_b.contiguous(),
                          std::nullopt, std::nullopt, mm_dtype)
        .to(out_dtype);
  }
  return at::matmul(a.dequantize(), b.dequantize().t()).to(out_dtype);
}

torch::Tensor float8_linear(const torch::Tensor& x, const torch::Tensor& weight, Recipe recipe,
                            const Float8Sharding& sharding) {
  LOOM_REQUIRE(weight.dim() == 2 && x.size(-1) == weight.size(1), "float8_linear: input ", x.sizes(),
               " does not match weight ", weight.sizes());
  return Float8Linear::apply(x, weight, static_cast<int64_t>(recipe), sharding);
}

}  // namespace loom::float8
