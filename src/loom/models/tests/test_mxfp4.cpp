// MXFP4 dequantisation (model_dir.h), which the Hugging Face loader applies to GPT-OSS's published
// expert weights: hand-computed values and transformers' layout ([..., G * 32, R] from rows of R).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "loom/core/error.h"
#include "loom/models/common/model_dir.h"

namespace {

using loom::models::dequantize_mxfp4;

TEST(Mxfp4, NibblesAreE2m1ValuesScaledByTheirBlocksPowerOfTwo) {
  // One expert, two rows (R = 2), one block of 32 values per row.
  torch::Tensor blocks = torch::zeros({1, 2, 1, 16}, torch::kUInt8);
  torch::Tensor scales = torch::full({1, 2, 1}, 127, torch::kUInt8);
  blocks[0][0][0][0] = 0x21;  // low nibble 1 = 0.5, high nibble 2 = 1.0
  blocks[0][0][0][15] = 0xF7;  // low 7 = 6.0, high 15 = -6.0
  blocks[0][1][0][3] = 0x9C;  // low 12 = -2.0, high 9 = -0.5
  scales[0][1][0] = 130;      // row 1: x 2^3
  const torch::Tensor out = dequantize_mxfp4(blocks, scales);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, 32, 2}));  // [experts, in = G * 32, out = R]
  ASSERT_EQ(out.scalar_type(), torch::kFloat32);
  EXPECT_EQ(out[0][0][0].item<float>(), 0.5f);
  EXPECT_EQ(out[0][1][0].item<float>(), 1.0f);
  EXPECT_EQ(out[0][30][0].item<float>(), 6.0f);
  EXPECT_EQ(out[0][31][0].item<float>(), -6.0f);
  EXPECT_EQ(out[0][6][1].item<float>(), -16.0f);
  EXPECT_EQ(out[0][7][1].item<float>(), -4.0f);
  // Everything else is zero.
  EXPECT_EQ(out.abs().sum().item<float>(), 0.5f + 1 + 6 + 6 + 16 + 4);
}

TEST(Mxfp4, EveryByteAndScaleAgreesWithTheFormatsDefinition) {
  // All 256 bytes in a row of 16 blocks, scales from 2^-127 to 2^127.
  torch::Tensor blocks = torch::arange(256, torch::kInt64).to(torch::kUInt8).reshape({1, 16, 16}).repeat({3, 1, 1});
  blocks = blocks.reshape({3, 1, 16, 16});  // E = 3, R = 1, G = 16
  torch::Tensor scales = torch::tensor({0, 1, 100, 127, 128, 200, 254, 60, 70, 80, 90, 110, 120, 126, 129, 140},
                                       torch::kInt64)
                             .to(torch::kUInt8)
                             .reshape({1, 1, 16})
                             .repeat({3, 1, 1});
  const torch::Tensor out = dequantize_mxfp4(blocks, scales);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{3, 512, 1}));
  // The definition: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; subnormal at exponent 0.
  auto e2m1 = [](int v) {
    const double sign = (v & 8) ? -1.0 : 1.0;
    const int e = (v >> 1) & 3, m = v & 1;
    return sign * (e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1));
  };
  for (int64_t e = 0; e < 3; ++e) {
    for (int g = 0; g < 16; ++g) {
      const int exponent = scales[e][0][g].item<int>() - 127;
      for (int b = 0; b < 16; ++b) {
        const int byte = blocks[e][0][g][b].item<int>();
        EXPECT_EQ(out[e][g * 32 + 2 * b][0].item<float>(), static_cast<float>(std::ldexp(e2m1(byte & 15), exponent)));
        EXPECT_EQ(out[e][g * 32 + 2 * b + 1][0].item<float>(), static_cast<float>(std::ldexp(e2m1(byte >> 4), exponent)));
      }
    }
  }
}

TEST(Mxfp4, MisshapedScalesAreRefused) {
  EXPECT_THROW(dequantize_mxfp4(torch::zeros({1, 2, 1, 16}, torch::kUInt8), torch::zeros({1, 2, 2}, torch::kUInt8)),
               loom::Error);
  EXPECT_THROW(dequantize_mxfp4(torch::zeros({1, 2, 1, 8}, torch::kUInt8), torch::zeros({1, 2, 1}, torch::kUInt8)),
               loom::Error);
}

}  // namespace
