// Block-wise 8-bit AdamW: the quantization maps and one block's quantize/dequantize against
// independent references (bitsandbytes' map formula written with torch ops, a brute-force nearest
// code search, hand-computed values), the update against optim::AdamW, and the state's size.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>

#include "loom/optim/adamw.h"
#include "loom/optim/adamw8bit.h"

namespace {
using namespace loom::optim;

// bitsandbytes.functional.create_dynamic_map(signed, 7, 8) transcribed with torch ops, as the
// Python does it: torch.linspace boundaries, float32 midpoints, scaled by the Python float
// 10 ** (i - 6).
torch::Tensor bitsandbytes_dynamic_map(bool is_signed) {
  std::vector<torch::Tensor> data;
  for (int i = 0; i < 7; ++i) {
    const int64_t items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const torch::Tensor boundaries = torch::linspace(0.1, 1, items, torch::kFloat32);
    const torch::Tensor means = (boundaries.narrow(0, 0, items - 1) + boundaries.narrow(0, 1, items - 1)) / 2.0;
    data.push_back(std::pow(10.0, i - 6) * means);
    if (is_signed) data.push_back(-std::pow(10.0, i - 6) * means);
  }
  data.push_back(torch::tensor({0.0f, 1.0f}));
  return std::get<0>(torch::cat(data).sort());
}

torch::Tensor as_tensor(const std::array<float, 256>& map) {
  return torch::from_blob(const_cast<float*>(map.data()), {256}, torch::kFloat32).clone();
}

TEST(AdamW8bitQuantization, DynamicMapsEqualTheBitsandbytesFormula) {
  for (bool is_signed : {true, false}) {
    const torch::Tensor want = bitsandbytes_dynamic_map(is_signed);
    const torch::Tensor got = as_tensor(is_signed ? signed_dynamic_map() : unsigned_dynamic_map());
    ASSERT_EQ(want.numel(), 256);
    EXPECT_TRUE(torch::equal(got, want)) << (is_signed ? "signed" : "unsigned") << " max diff "
                                         << (got - want).abs().max().item<float>();
  }
  // Hand-checked entries: both hold 0 and 1 at the top; the smallest non-zero magnitude is
  // 1e-6 x 0.55 (signed: the one midpoint of linspace(0.1, 1, 2)); the signed map's most negative
  // entry is -(0.9859375 + 1) / 2.
  const auto& s = signed_dynamic_map();
  const auto& u = unsigned_dynamic_map();
  EXPECT_EQ(s[255], 1.0f);
  EXPECT_EQ(u[255], 1.0f);
  EXPECT_EQ(u[0], 0.0f);
  EXPECT_EQ(s[127], 0.0f);
  EXPECT_NEAR(s[128], 0.55e-6, 1e-12);
  EXPECT_NEAR(s[0], -0.99296875, 1e-7);
}

TEST(AdamW8bitQuantization, QuantizeBlockEqualsBruteForceNearestCode) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  for (bool is_signed : {true, false}) {
    const auto& map = is_signed ? signed_dynamic_map() : unsigned_dynamic_map();
    const torch::Tensor map_t = as_tensor(map);
    for (int trial = 0; trial < 20; ++trial) {
      // Values over 8 decades, as a second moment's block has.
      torch::Tensor x = torch::randn({256}, gen) * torch::pow(10.0, torch::randint(-8, 1, {256}, gen).to(torch::kFloat));
      if (!is_signed) x = x.abs();
      std::vector<uint8_t> codes(256);
      const float absmax = quantize_block(x.data_ptr<float>(), 256, map, codes.data());
      // Reference: torch's absmax, then for each element the first map entry of least distance.
      const float want_absmax = x.abs().max().item<float>();
      ASSERT_EQ(absmax, want_absmax);
      const torch::Tensor normalized = x / want_absmax;
      const torch::Tensor want_codes = (normalized.unsqueeze(1) - map_t.unsqueeze(0)).abs().argmin(1);
      for (int64_t i = 0; i < 256; ++i) {
        ASSERT_EQ(codes[i], want_codes[i].item<int64_t>()) << "element " << i << " = " << x[i].item<float>();
      }
      std::vector<float> back(256);
      dequantize_block(codes.data(), 256, absmax, map, back.data());
      const torch::Tensor want_back = map_t.index_select(0, want_codes) * want_absmax;
      EXPECT_TRUE(torch::equal(torch::from_blob(back.data(), {256}), want_back));
    }
  }
}

TEST(AdamW8bitQuantization, HandComputedBlock) {
  // absmax 2: normalized [1, -0.5, 0.25, 0]. 1 and 0 are map entries (exact); -0.5 and 0.25 fall
  // in the top decade, whose 64 midpoints of linspace(0.1, 1, 65) are 0.9 / 64 apart.
  const float x[4] = {2.0f, -1.0f, 0.5f, 0.0f};
  uint8_t codes[4];
  const auto& map = signed_dynamic_map();
  EXPECT_EQ(quantize_block(x, 4, map, codes), 2.0f);
  EXPECT_EQ(codes[0], 255);
  EXPECT_EQ(codes[3], 127);
  float back[4];
  dequantize_block(codes, 4, 2.0f, map, back);
  EXPECT_EQ(back[0], 2.0f);
  EXPECT_EQ(back[3], 0.0f);
  EXPECT_NEAR(back[1], -1.0f, 2.0 * 0.9 / 64 / 2);
  EXPECT_NEAR(back[2], 0.5f, 2.0 * 0.9 / 64 / 2);
  // A block of zeros: absmax 0, every code that of 0.
  const float zeros[3] = {0.0f, -0.0f, 0.0f};
  EXPECT_EQ(quantize_block(zeros, 3, map, codes), 0.0f);
  EXPECT_EQ(codes[0], 127);
  EXPECT_EQ(codes[1], 127);
}

TEST(AdamW8bitQuantization, WhichParametersAreQuantized) {
  EXPECT_TRUE(is_block_quantized(4096, 256));
  EXPECT_FALSE(is_block_quantized(3840, 256));  // under 4096 elements
  EXPECT_FALSE(is_block_quantized(4096 + 128, 256));      // not whole blocks
  EXPECT_FALSE(is_block_quantized(256, 256));             // a norm scale
}

// Two parameters: a quantized 64 x 128 matrix and a 64-element bias with float32 moments.
struct Params {
  torch::Tensor w, b;
  NamedTensors named() const { return {{"w", w}, {"b", b}}; }
};
Params make_quantizable_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  return {torch::randn({64, 128}, gen), torch::randn({64}, gen)};
}
torch::Tensor grad_of(const torch::Tensor& p, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step + p.numel());
  return torch::randn(p.sizes(), gen) * 1e-2;
}

TEST(AdamW8bit, TracksAdamW) {
  const AdamWOptions options{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  Params a = make_quantizable_params(), q = make_quantizable_params();
  AdamW fp32(weight_decay_param_groups(a.named(), 0.1), options);
  AdamW8bit eight(weight_decay_param_groups(q.named(), 0.1), options, 256);
  EXPECT_TRUE(eight.state("w").quantized);
  EXPECT_FALSE(eight.state("b").quantized);
  const torch::Tensor w0 = a.w.clone();
  for (int step = 1; step <= 30; ++step) {
    for (auto* p : {&a.w, &a.b}) p->mutable_grad() = grad_of(*p, step);
    for (auto* p : {&q.w, &q.b}) p->mutable_grad() = grad_of(*p, step);
    fp32.step();
    eight.step();
    if (step == 1) {
      // The first update uses the freshly computed moments (quantization only touches what is
      // stored), so it is AdamW's up to float rounding.
      EXPECT_LE((q.w - a.w).abs().max().item<double>(), 1e-6);
    }
  }
  // Float32 moments: AdamW's formula, same rounding up to a few ulps.
  EXPECT_LE((q.b - a.b).abs().max().item<double>(), 1e-6);
  // Quantized moments: the parameter change agrees with AdamW's within a few percent.
  const double change = (a.w - w0).norm().item<double>();
  const double diff = (q.w - a.w).norm().item<double>();
  std::printf("AdamW8bit vs AdamW after 30 steps: |dW| %.4e, |W8 - W32| %.4e (%.2f %%)\n", change, diff,
              100 * diff / change);
  EXPECT_LE(diff, 0.05 * change);
  EXPECT_GT(change, 1e-3);
  // The state round-trips through its state dict (codes, scales, step counts).
  AdamW8bit other(weight_decay_param_groups(make_quantizable_params().named(), 0.1), options, 256);
  other.load_state_dict(eight.state_dict());
  for (const auto& [key, t] : eight.state_dict()) EXPECT_TRUE(torch::equal(other.state_dict().at(key), t)) << key;
  EXPECT_EQ(eight.state_dict().at("w.exp_avg").scalar_type(), torch::kChar);
  EXPECT_EQ(eight.state_dict().at("w.exp_avg_sq").scalar_type(), torch::kByte);
  EXPECT_EQ(eight.state_dict().at("w.exp_avg.absmax").sizes(), torch::IntArrayRef({32}));
}

// Acceptance (1): the Llama 3 debug model's parameter shapes (dim 256, 6 layers, FFN 768, vocab
// 2048), state bytes measured from the state tensors.
TEST(AdamW8bit, StateIsUnderThirtyPercentOfAdamWOnTheDebugModel) {
  NamedTensors named;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    named.emplace_back(name, torch::zeros(shape));
  };
  add("tok_embeddings.weight", {2048, 256});
  for (int l = 0; l < 6; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (const char* w : {"wq", "wk", "wv", "wo"}) add(p + "attention." + w + ".weight", {256, 256});
    add(p + "feed_forward.w1.weight", {768, 256});
    add(p + "feed_forward.w2.weight", {256, 768});
    add(p + "feed_forward.w3.weight", {768, 256});
    add(p + "attention_norm.weight", {256});
    add(p + "ffn_norm.weight", {256});
  }
  add("norm.weight", {256});
  add("output.weight", {2048, 256});
  int64_t numel = 0;
  for (const auto& [n, t] : named) numel += t.numel();
  AdamW fp32(weight_decay_param_groups(named, 0.1), {});
  int64_t fp32_bytes = 0;
  for (const auto& [key, t] : fp32.state_dict()) {
    if (key.ends_with(".exp_avg") || key.ends_with(".exp_avg_sq")) fp32_bytes += t.nbytes();
  }
  for (int64_t block : {256, 2048}) {
    AdamW8bit eight(weight_decay_param_groups(named, 0.1), {}, block);
    const int64_t bytes = eight.state_nbytes();
    int64_t from_dict = 0;
    for (const auto& [key, t] : eight.state_dict()) {
      if (!key.ends_with(".step")) from_dict += t.nbytes();
    }
    EXPECT_EQ(bytes, from_dict);
    const double ratio = static_cast<double>(bytes) / static_cast<double>(fp32_bytes);
    std::printf("debug model, %lld parameters, block %lld: AdamW %.4f B/param, AdamW8bit %.4f B/param "
                "(quantized only: 2 + 8/%lld = %.4f), ratio %.3f\n",
                static_cast<long long>(numel), static_cast<long long>(block),
                static_cast<double>(fp32_bytes) / numel, static_cast<double>(bytes) / numel,
                static_cast<long long>(block), 2.0 + 8.0 / block, ratio);
    EXPECT_LE(ratio, 0.3);
  }
}

}  // namespace
