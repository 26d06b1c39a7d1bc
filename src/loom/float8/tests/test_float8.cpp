// Float8 linears on the CPU (the exact emulation): forward and both backward GEMMs equal a
// quantize-dequantize reference written here element by element (scales from frexp, float8
// rounding through c10's scalar Float8 types, products in float64), for the rowwise and the
// tensorwise recipe; scales are powers of 2 (rowwise), values never overflow, zero rows stay zero;
// convert_to_float8 converts what it should, keeps what the filter names, and refuses dims the
// float8 GEMMs cannot take.
#include <gtest/gtest.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/float8/convert.h"
#include "loom/float8/float8.h"
#include "loom/nn/layers.h"

namespace {

namespace f8 = loom::float8;
namespace nn = loom::nn;
using f8::Recipe;

// A float8 value as c10's scalar type rounds it (round to nearest even), back in double.
double round_to(double v, c10::ScalarType dtype) {
  const float f = static_cast<float>(v);
  return dtype == torch::kFloat8_e4m3fn ? static_cast<double>(static_cast<float>(c10::Float8_e4m3fn(f)))
                                        : static_cast<double>(static_cast<float>(c10::Float8_e5m2(f)));
}

// The largest power of 2 not above v (v > 0), from the exponent alone.
double power_of_2_floor(double v) {
  int exponent = 0;
  std::frexp(v, &exponent);  // v = m * 2^exponent, m in [0.5, 1)
  return std::ldexp(1.0, exponent - 1);
}

// Reference quantize-dequantize of a 2-D tensor contracting its last dim, as float64: per row
// (rowwise, power-of-2 scales) or per tensor (tensorwise), then fmax-saturated float8 rounding.
torch::Tensor reference_qdq(const torch::Tensor& t, c10::ScalarType dtype, Recipe recipe) {
  const double fmax = dtype == torch::kFloat8_e4m3fn ? 448.0 : 57344.0;
  const torch::Tensor in = t.to(torch::kFloat64).contiguous();
  torch::Tensor out = torch::empty_like(in);
  auto a = in.accessor<double, 2>();
  auto o = out.accessor<double, 2>();
  double tensor_amax = 0;
  for (int64_t i = 0; i < in.size(0); ++i)
    for (int64_t j = 0; j < in.size(1); ++j) tensor_amax = std::max(tensor_amax, std::abs(a[i][j]));
  for (int64_t i = 0; i < in.size(0); ++i) {
    double amax = 0;
    for (int64_t j = 0; j < in.size(1); ++j) amax = std::max(amax, std::abs(a[i][j]));
    if (recipe == Recipe::kTensorwise) amax = tensor_amax;
    double scale = static_cast<float>(fmax / std::max(amax, 1e-12));
    if (recipe == Recipe::kRowwise) scale = power_of_2_floor(scale);
    for (int64_t j = 0; j < in.size(1); ++j) {
      const double scaled = static_cast<float>(static_cast<float>(a[i][j]) * static_cast<float>(scale));
      o[i][j] = round_to(std::clamp(scaled, -fmax, fmax), dtype) / scale;
    }
  }
  return out;
}

// x [M, K] (rows of tokens), W [N, K] with rows of very different magnitudes, a zero row in each,
// and a few outliers, so per-row and per-tensor scales differ.
struct Problem {
  torch::Tensor x, w, dy;
};
Problem make_problem(int64_t m, int64_t k, int64_t n) {
  torch::manual_seed(7);
  Problem p;
  p.x = torch::randn({m, k}) * torch::logspace(-3, 2, m).unsqueeze(1);
  p.w = torch::randn({n, k}) * torch::logspace(-2, 1, n).unsqueeze(1);
  p.dy = torch::randn({m, n}) * torch::logspace(-6, -1, m).unsqueeze(1);
  p.x[3].zero_();
  p.w[5].zero_();
  p.dy[4].zero_();
  p.x[1][2] = 900.0;
  return p;
}

double max_abs(const torch::Tensor& t) { return t.abs().max().item<double>(); }

TEST(Float8, RecipesAreTorchaosAndUnknownNamesSuggestTheNearest) {
  EXPECT_EQ(loom::options::parse_enum<Recipe>("rowwise", "float8.recipe"), Recipe::kRowwise);
  EXPECT_EQ(loom::options::parse_enum<Recipe>("tensorwise", "float8.recipe"), Recipe::kTensorwise);
  try {
    loom::options::parse_enum<Recipe>("rowwize", "float8.recipe");
    FAIL() << "no error";
  } catch (const loom::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean \"rowwise\""), std::string::npos) << e.what();
  }
  EXPECT_DOUBLE_EQ(f8::float8_max(torch::kFloat8_e4m3fn), 448.0);
  EXPECT_DOUBLE_EQ(f8::float8_max(torch::kFloat8_e5m2), 57344.0);
}

TEST(Float8, RowwiseScalesArePowersOfTwoAtMostFmaxOverAmax) {
  const Problem p = make_problem(32, 48, 16);
  const f8::Float8Operand q = f8::quantize(p.x, torch::kFloat8_e4m3fn, Recipe::kRowwise);
  ASSERT_EQ(q.scale.sizes(), (std::vector<int64_t>{32, 1}));
  EXPECT_EQ(q.data.scalar_type(), torch::kFloat8_e4m3fn);
  const torch::Tensor amax = p.x.abs().amax(1);
  for (int64_t i = 0; i < 32; ++i) {
    const double s = q.scale[i][0].item<double>();
    const double a = amax[i].item<double>();
    int exponent = 0;
    EXPECT_EQ(std::frexp(s, &exponent), 0.5) << "row " << i << " scale " << s << " is not a power of 2";
    EXPECT_EQ(s, power_of_2_floor(448.0 / std::max(a, 1e-12))) << "row " << i;
    // Rounded down, by less than a factor 2: the row's largest value lands in (224, 448].
    if (a > 0) {
      EXPECT_LE(a * s, 448.0) << i;
      EXPECT_GT(a * s, 224.0) << i;
    }
  }
}

TEST(Float8, ValuesNeverOverflowAndZeroRowsStayZero) {
  // Tensorwise scales are not rounded: 448 / amax in float32 can round up, so amax * scale lands
  // just above 448 and only the clamp keeps it finite (float8_e4m3fn has no inf: an overflowing
  // cast would be NaN). Find such an amax, then check the quantized value saturates at 448.
  float amax = 1.0f;
  bool found = false;
  for (int i = 0; i < 10000 && !found; ++i) {
    amax = 1.0f + static_cast<float>(i) * 0.000123f;
    const float scale = static_cast<float>(448.0 / static_cast<double>(amax));
    found = amax * scale > 448.0f;
  }
  ASSERT_TRUE(found);
  const torch::Tensor t = torch::tensor({{amax, -amax, 0.5f}});
  const f8::Float8Operand q = f8::quantize(t, torch::kFloat8_e4m3fn, Recipe::kTensorwise);
  const torch::Tensor data = q.data.to(torch::kFloat32);
  EXPECT_EQ(data[0][0].item<float>(), 448.0f);
  EXPECT_EQ(data[0][1].item<float>(), -448.0f);
  EXPECT_TRUE(torch::isfinite(q.dequantize()).all().item<bool>());
  // Every recipe and dtype on huge and tiny values: all finite, nothing beyond fmax.
  const torch::Tensor wild = torch::tensor({{3e38f, -1e30f, 1e-30f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}});
  for (auto dtype : {torch::kFloat8_e4m3fn, torch::kFloat8_e5m2}) {
    for (auto recipe : {Recipe::kRowwise, Recipe::kTensorwise}) {
      const f8::Float8Operand w = f8::quantize(wild, dtype, recipe);
      const torch::Tensor v = w.data.to(torch::kFloat32);
      EXPECT_TRUE(torch::isfinite(v).all().item<bool>()) << loom::options::enum_name(recipe);
      EXPECT_LE(max_abs(v), f8::float8_max(dtype));
      EXPECT_TRUE(torch::isfinite(w.scale).all().item<bool>());
      EXPECT_EQ(max_abs(w.dequantize()[1]), 0.0) << "the zero row stays zero";
    }
  }
}

class Float8Linear : public ::testing::TestWithParam<Recipe> {};

TEST_P(Float8Linear, ForwardAndBackwardMatchTheQuantizeDequantizeReference) {
  const Recipe recipe = GetParam();
  const auto grad_dtype = recipe == Recipe::kRowwise ? torch::kFloat8_e4m3fn : torch::kFloat8_e5m2;
  const int64_t b = 2, t = 16, k = 48, n = 32;
  const Problem p = make_problem(b * t, k, n);
  const torch::Tensor x = p.x.view({b, t, k}).clone().requires_grad_(true);
  const torch::Tensor w = p.w.clone().requires_grad_(true);
  const torch::Tensor y = f8::float8_linear(x, w, recipe);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{b, t, n}));
  EXPECT_EQ(y.scalar_type(), torch::kFloat32);
  y.backward(p.dy.view({b, t, n}));

  const torch::Tensor want_y = at::matmul(reference_qdq(p.x, torch::kFloat8_e4m3fn, recipe),
                                          reference_qdq(p.w, torch::kFloat8_e4m3fn, recipe).t());
  const torch::Tensor want_dx = at::matmul(reference_qdq(p.dy, grad_dtype, recipe),
                                           reference_qdq(p.w.t(), torch::kFloat8_e4m3fn, recipe).t());
  const torch::Tensor want_dw = at::matmul(reference_qdq(p.dy.t(), grad_dtype, recipe),
                                           reference_qdq(p.x.t(), torch::kFloat8_e4m3fn, recipe).t());
  // Relative to each result's largest element: the float32 GEMM against the float64 one.
  const double ey = max_abs(y.detach().view({b * t, n}).to(torch::kFloat64) - want_y) / max_abs(want_y);
  const double edx = max_abs(x.grad().view({b * t, k}).to(torch::kFloat64) - want_dx) / max_abs(want_dx);
  const double edw = max_abs(w.grad().to(torch::kFloat64) - want_dw) / max_abs(want_dw);
  std::cout << "[" << loom::options::enum_name(recipe) << "] max |float8 - reference| / max |reference|: y " << ey
            << ", dx " << edx << ", dw " << edw << "\n";
  EXPECT_LT(ey, 1e-6);
  EXPECT_LT(edx, 1e-6);
  EXPECT_LT(edw, 1e-6);
  // The zero row of x gives a zero row of y; the zero row of W a zero column of y.
  EXPECT_EQ(max_abs(y.detach().view({b * t, n})[3]), 0.0);
  EXPECT_EQ(max_abs(y.detach().view({b * t, n}).select(1, 5)), 0.0);
  // Quantization changes the result (this is not the high-precision linear), but not by much.
  const torch::Tensor exact = at::linear(p.x, p.w);
  const double rel = (y.detach().view({b * t, n}) - exact).norm().item<double>() / exact.norm().item<double>();
  std::cout << "[" << loom::options::enum_name(recipe) << "] ||y - x W^T|| / ||x W^T|| = " << rel << "\n";
  EXPECT_GT(rel, 0.0);
  EXPECT_LT(rel, 0.1);
}

TEST_P(Float8Linear, AutocastGivesTheAutocastDtypeFromTheFloat32Emulation) {
  const Recipe recipe = GetParam();
  const Problem p = make_problem(16, 32, 16);
  torch::Tensor y;
  {
    loom::AutocastScope scope(c10::Device(c10::kCPU), torch::kBFloat16);
    y = f8::float8_linear(p.x, p.w, recipe);
  }
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  const torch::Tensor want = f8::float8_linear(p.x, p.w, recipe).to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(y, want));
}

INSTANTIATE_TEST_SUITE_P(Recipes, Float8Linear, ::testing::Values(Recipe::kRowwise, Recipe::kTensorwise),
                         [](const auto& info) { return std::string(loom::options::enum_name(info.param)); });

// A tiny model: two FFNs and an output head.
class Tiny : public nn::Module {
 public:
  explicit Tiny(int64_t dim) : nn::Module("Tiny") {
    const auto options = torch::TensorOptions().dtype(torch::kFloat32);
    ffn_ = register_module("feed_forward", std::make_shared<nn::FeedForward>(dim, 64, options));
    output_ = register_module("output", std::make_shared<nn::Linear>(dim, 32, options));
    for (auto& p : named_parameters()) {
      torch::NoGradGuard no_grad;
      p.slot->tensor.normal_(0, 0.1);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return output_->forward(ffn_->forward(x)); }
  nn::FeedForward& ffn() { return *ffn_; }
  nn::Linear& output() { return *output_; }

 private:
  std::shared_ptr<nn::FeedForward> ffn_;
  std::shared_ptr<nn::Linear> output_;
};

TEST(ConvertToFloat8, ConvertsEveryLinearButTheFilteredOnes) {
  torch::manual_seed(0);
  Tiny model(32);
  const auto options = f8::Float8Options::from({.filter_fqns = " output , ,"});
  EXPECT_EQ(options.filter_fqns, (std::vector<std::string>{"output"}));
  const auto report = f8::convert_to_float8(model, options);
  EXPECT_EQ(report.converted,
            (std::vector<std::string>{"feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}));
  EXPECT_EQ(report.kept, (std::vector<std::string>{"output"}));
  EXPECT_EQ(report.describe(Recipe::kRowwise), "3 linears to float8 (rowwise), 1 kept in high precision: output");
  EXPECT_TRUE(model.ffn().w1().forward_override() != nullptr);
  EXPECT_TRUE(model.output().forward_override() == nullptr);

  // The hooked linear computes float8_linear from the weight its slot holds now: swap the weight
  // as FSDP does and the next call uses the new one.
  const torch::Tensor x = torch::randn({2, 16, 32});
  EXPECT_TRUE(torch::equal(model.ffn().w1().forward(x), f8::float8_linear(x, model.ffn().w1().weight(), Recipe::kRowwise)));
  model.set_parameter("feed_forward.w1.weight", torch::randn({64, 32}));
  EXPECT_TRUE(torch::equal(model.ffn().w1().forward(x), f8::float8_linear(x, model.ffn().w1().weight(), Recipe::kRowwise)));
  // Training through it gives every parameter a gradient.
  model.forward(x).square().sum().backward();
  for (auto& p : model.named_parameters()) EXPECT_TRUE(p.tensor().grad().defined()) << p.name;
}

TEST(ConvertToFloat8, DimsNotMultipleOf16AreRefusedNamingTheLayerAndTheFix) {
  Tiny model(40);  // w1, w3: 40 -> 64, w2: 64 -> 40
  try {
    f8::convert_to_float8(model, f8::Float8Options::from({}));
    FAIL() << "no error";
  } catch (const loom::UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'feed_forward.w1' is 40 -> 64"), std::string::npos) << msg;
    EXPECT_NE(msg.find("float8.filter_fqns"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
  }
  // Filtering the FFN keeps it in high precision: nothing left to convert.
  Tiny kept(40);
  const auto report = f8::convert_to_float8(kept, f8::Float8Options::from({.filter_fqns = "output,feed_forward"}));
  EXPECT_TRUE(report.converted.empty());
  EXPECT_EQ(report.kept.size(), 4u);
}

}  // namespace
