#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/nn/attention.h"
#include "loom/nn/init.h"
#include "loom/nn/layers.h"
#include "loom/nn/module.h"
#include "loom/nn/rope.h"

namespace {
using namespace loom::nn;

const auto kCpu = torch::TensorOptions().dtype(torch::kFloat32);

// Two levels of nesting, a buffer and a frozen parameter: enough to check naming and order.
class Block : public Module {
 public:
  Block() : Module("Block") {
    scale = register_parameter("scale", torch::ones({4}, kCpu));
    proj = register_module("proj", std::make_shared<Linear>(4, 3, kCpu));
    register_buffer("steps", torch::zeros({1}, torch::kInt64));
    register_buffer("cache", torch::zeros({2}, kCpu), /*persistent=*/false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return call_with_hooks(x, [this](const torch::Tensor& in) {
      return proj->forward(in * scale->tensor);
    });
  }
  ParameterSlot* scale;
  std::shared_ptr<Linear> proj;
};

class Net : public Module {
 public:
  Net() : Module("Net") {
    embed = register_module("embed", std::make_shared<Embedding>(10, 4, kCpu));
    layers = register_module("layers", std::make_shared<ModuleDict>());
    for (int i = 0; i < 2; ++i) layers->add(std::to_string(i), std::make_shared<Block>());
    register_parameter("frozen", torch::zeros({2}, kCpu), /*requires_grad=*/false);
  }
  std::shared_ptr<Embedding> embed;
  std::shared_ptr<ModuleDict> layers;
};

std::vector<std::string> names(const std::vector<NamedParameter>& params) {
  std::vector<std::string> out;
  for (const auto& p : params) out.push_back(p.name);
  return out;
}

TEST(Module, NamesParametersInRegistrationOrderWithDottedPaths) {
  Net net;
  EXPECT_EQ(names(net.named_parameters()),
            (std::vector<std::string>{"frozen", "embed.weight", "layers.0.scale",
                                      "layers.0.proj.weight", "layers.1.scale",
                                      "layers.1.proj.weight"}));
  EXPECT_EQ(names(net.named_parameters(/*recurse=*/false)), std::vector<std::string>{"frozen"});
  std::vector<std::string> modules;
  for (const auto& [name, m] : net.named_modules()) modules.push_back(name + ":" + m->type_name());
  EXPECT_EQ(modules, (std::vector<std::string>{":Net", "embed:Embedding", "layers:ModuleDict",
                                               "layers.0:Block", "layers.0.proj:Linear",
                                               "layers.1:Block", "layers.1.proj:Linear"}));
  EXPECT_EQ(net.num_parameters(), 2 + 40 + 2 * (4 + 12));
  EXPECT_FALSE(net.parameter("frozen").requires_grad());
  EXPECT_TRUE(net.parameter("layers.1.proj.weight").requires_grad());
  // state_dict: parameters then persistent buffers only.
  std::vector<std::string> keys;
  for (const auto& [k, v] : net.state_dict()) keys.push_back(k);
  EXPECT_EQ(keys.size(), 6u + 2u);
  EXPECT_EQ(keys.back(), "layers.1.steps");
  EXPECT_EQ(net.named_buffers().size(), 4u);
}

TEST(Module, RejectsDuplicateAndDottedNamesAndMissingPaths) {
  Block block;
  EXPECT_THROW(block.register_parameter("scale", torch::ones({1})), c10::Error);
  EXPECT_THROW(block.register_buffer("a.b", torch::ones({1})), c10::Error);
  EXPECT_THROW(block.parameter("proj.bias"), loom::Error);
  EXPECT_THROW(block.submodule("nope"), loom::Error);
  EXPECT_EQ(block.find_submodule("nope"), nullptr);
  EXPECT_EQ(block.find_submodule("proj"), block.proj.get());
}

TEST(Module, SlotsAreStableAndSetParameterRepointsTheLayer) {
  Net net;
  auto before = net.named_parameters();
  ParameterSlot* slot = before[3].slot;  // layers.0.proj.weight
  ASSERT_EQ(before[3].name, "layers.0.proj.weight");
  // A flat buffer with the weight as a view into it: what FSDP installs.
  torch::Tensor flat = torch::arange(20, kCpu);
  net.set_parameter("layers.0.proj.weight", flat.narrow(0, 4, 12).view({3, 4}));
  EXPECT_EQ(net.named_parameters()[3].slot, slot);
  EXPECT_TRUE(slot->tensor.requires_grad());
  EXPECT_EQ(slot->tensor.data_ptr<float>(), flat.data_ptr<float>() + 4);
  auto& block = static_cast<Block&>(net.submodule("layers.0"));
  block.proj->set_parameter("weight", torch::eye(3, 4, kCpu));
  torch::Tensor x = torch::ones({1, 4}, kCpu) * 2;
  EXPECT_TRUE(torch::allclose(block.forward(x), torch::full({1, 3}, 2.0f)));
  // Changing a shape is allowed (FSDP shards), and the layer sees the new tensor.
  net.set_parameter("layers.1.scale", torch::full({1}, 3.0f, kCpu));
  EXPECT_EQ(net.parameter("layers.1.scale").numel(), 1);
}

TEST(Module, HooksRunInOrderCanReplaceTensorsAndBeRemoved) {
  Block block;
  block.proj->set_parameter("weight", torch::eye(3, 4, kCpu));
  std::vector<std::string> calls;
  auto pre1 = block.add_forward_pre_hook([&](Module& m, torch::Tensor in) {
    calls.push_back("pre1:" + m.type_name());
    return in * 2;
  });
  auto pre2 = block.add_forward_pre_hook([&](Module&, torch::Tensor in) {
    calls.push_back("pre2");
    return in + 1;
  });
  auto post = block.add_forward_post_hook([&](Module&, torch::Tensor in, torch::Tensor out) {
    calls.push_back("post");
    EXPECT_TRUE(torch::allclose(in, torch::full({1, 4}, 3.0f)));  // sees the hooked input
    return out * 10;
  });
  torch::Tensor y = block.forward(torch::ones({1, 4}, kCpu));
  EXPECT_EQ(calls, (std::vector<std::string>{"pre1:Block", "pre2", "post"}));
  EXPECT_TRUE(torch::allclose(y, torch::full({1, 3}, 30.0f)));
  pre1.remove();
  pre2.remove();
  post.remove();
  post.remove();  // idempotent
  EXPECT_FALSE(block.has_forward_hooks());
  EXPECT_TRUE(torch::allclose(block.forward(torch::ones({1, 4}, kCpu)), torch::ones({1, 3})));
  // A hook may remove itself while running.
  HookHandle self;
  int runs = 0;
  self = block.add_forward_pre_hook([&](Module&, torch::Tensor in) {
    ++runs;
    self.remove();
    return in;
  });
  block.forward(torch::ones({1, 4}, kCpu));
  block.forward(torch::ones({1, 4}, kCpu));
  EXPECT_EQ(runs, 1);
}

TEST(Module, ConvertsMaterializesAndZeroesGradients) {
  Net net;
  net.to(torch::kBFloat16);
  EXPECT_EQ(net.parameter("embed.weight").scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net.buffer("layers.0.steps").scalar_type(), torch::kInt64);  // integers untouched
  EXPECT_TRUE(net.parameter("embed.weight").is_leaf());
  EXPECT_TRUE(net.parameter("embed.weight").requires_grad());
  net.to(torch::kFloat32);

  torch::Tensor x = torch::ones({2, 4}, kCpu);
  auto& block = static_cast<Block&>(net.submodule("layers.0"));
  block.forward(x).sum().backward();
  EXPECT_TRUE(block.proj->weight().grad().defined());
  net.zero_grad(/*set_to_none=*/false);
  EXPECT_EQ(block.proj->weight().grad().abs().sum().item<float>(), 0.0f);
  net.zero_grad();
  EXPECT_FALSE(block.proj->weight().grad().defined());

  net.train(false);
  EXPECT_FALSE(block.is_training());
  net.train();
  EXPECT_TRUE(block.proj->is_training());
}

TEST(Module, MetaBuildAllocatesNothingAndToEmptyMaterializes) {
  const auto meta = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta);
  Linear big(1 << 16, 1 << 16, meta);  // 16 GiB if it were real
  EXPECT_TRUE(big.weight().is_meta());
  EXPECT_EQ(big.num_parameters(), int64_t{1} << 32);
  Linear small(8, 4, meta);
  small.to_empty(torch::kCPU);
  EXPECT_TRUE(small.weight().device().is_cpu());
  EXPECT_TRUE(small.weight().requires_grad());
  EXPECT_EQ(small.weight().sizes(), (std::vector<int64_t>{4, 8}));
  torch::Tensor still_meta = big.weight();
  EXPECT_THROW(init_parameter(ParameterInit::ones(), "weight", 0, still_meta), loom::Error);
}

TEST(Init, DeterministicPerNameAndIndependentOfDestination) {
  torch::Tensor a = torch::empty({64, 32}, kCpu);
  torch::Tensor b = torch::empty({64, 32}, torch::kBFloat16);
  torch::Tensor c = torch::empty({32, 64}, kCpu).t();  // non-contiguous destination
  torch::Tensor other = torch::empty({64, 32}, kCpu);
  const auto init = ParameterInit::truncated_normal(0.02, -2, 2);
  init_parameter(init, "layers.0.w", 7, a);
  init_parameter(init, "layers.0.w", 7, b);
  init_parameter(init, "layers.0.w", 7, c);
  init_parameter(init, "layers.1.w", 7, other);
  EXPECT_TRUE(torch::equal(a.to(torch::kBFloat16), b));
  EXPECT_TRUE(torch::equal(a, c));
  EXPECT_FALSE(torch::equal(a, other));
  EXPECT_NE(parameter_seed(7, "x"), parameter_seed(8, "x"));
  EXPECT_NE(parameter_seed(7, "x"), parameter_seed(7, "y"));
}

TEST(Init, TruncatedNormalStatistics) {
  torch::Tensor t = torch::empty({400000}, kCpu);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  // Cut at +-1 std: the variance of a standard normal truncated to [-1, 1] is 0.291.
  trunc_normal_(t, 0.0, 2.0, -2.0, 2.0, gen);
  EXPECT_LE(t.max().item<float>(), 2.0f);
  EXPECT_GE(t.min().item<float>(), -2.0f);
  EXPECT_NEAR(t.mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(t.std().item<double>(), 2.0 * std::sqrt(0.29112), 0.01);
  torch::Tensor n = torch::empty({400000}, kCpu);
  normal_(n, 1.0, 0.5, gen);
  EXPECT_NEAR(n.mean().item<double>(), 1.0, 0.01);
  EXPECT_NEAR(n.std().item<double>(), 0.5, 0.01);
}

TEST(Layers, MatchReferenceMath) {
  torch::manual_seed(0);
  Linear lin(5, 3, kCpu, /*bias=*/true);
  lin.set_parameter("weight", torch::randn({3, 5}));
  lin.set_parameter("bias", torch::randn({3}));
  torch::Tensor x = torch::randn({2, 4, 5});
  EXPECT_TRUE(torch::allclose(lin.forward(x), torch::matmul(x, lin.weight().t()) +
                                                  lin.parameter("bias"), 1e-5, 1e-6));

  RMSNorm norm(5, 1e-5, kCpu);
  norm.set_parameter("weight", torch::randn({5}));
  torch::Tensor expected = x * torch::rsqrt(x.pow(2).mean(-1, true) + 1e-5) * norm.weight();
  EXPECT_TRUE(torch::allclose(norm.forward(x), expected, 1e-5, 1e-6));

  FeedForward ffn(5, 8, kCpu);
  for (auto& p : ffn.named_parameters()) ffn.set_parameter(p.name, torch::randn(p.tensor().sizes()));
  torch::Tensor ref = torch::matmul(torch::silu(torch::matmul(x, ffn.w1().weight().t())) *
                                        torch::matmul(x, ffn.w3().weight().t()),
                                    ffn.w2().weight().t());
  EXPECT_TRUE(torch::allclose(ffn.forward(x), ref, 1e-4, 1e-5));
  {
    torch::NoGradGuard no_grad;  // the in-place SwiGLU path
    EXPECT_TRUE(torch::allclose(ffn.forward(x), ref, 1e-4, 1e-5));
  }

  Embedding emb(10, 3, kCpu);
  emb.set_parameter("weight", torch::randn({10, 3}));
  torch::Tensor ids = torch::tensor({{1, 9}}, torch::kInt64);
  EXPECT_TRUE(torch::equal(emb.forward(ids)[0][1], emb.weight()[9]));
}

TEST(Rope, Llama3ScalingMatchesHandComputedFrequencies) {
  // head_dim 8, theta 10000: f_i = 10000^(-i/4) -> wavelengths 2 pi * {1, 10, 100, 1000}.
  // original_max_position 256, low 1, high 4: high-frequency cut at wavelength 64, low at 256.
  RopeScaling s{/*factor=*/8.0, /*low_freq_factor=*/1.0, /*high_freq_factor=*/4.0,
                /*original_max_position=*/256};
  torch::Tensor f = rope_inverse_frequencies(8, 10000.0, s);
  ASSERT_EQ(f.scalar_type(), torch::kFloat32);
  ASSERT_EQ(f.numel(), 4);
  // Wavelength 6.28 and 62.8 < 64: kept.
  EXPECT_NEAR(f[0].item<double>(), 1.0, 1e-7);
  EXPECT_NEAR(f[1].item<double>(), 0.1, 1e-7);
  // Wavelength 628 > 256: divided by 8.
  EXPECT_NEAR(f[2].item<double>(), 0.01 / 8, 1e-9);
  EXPECT_NEAR(f[3].item<double>(), 0.001 / 8, 1e-10);
  // A medium band: theta 10, head_dim 4 -> f = {1, 1/sqrt(10)}, wavelength 2 pi sqrt(10) = 19.87,
  // with original 40, high 4 -> cut 10, low 1 -> cut 40: smooth = (40/19.87 - 1) / 3.
  RopeScaling m{8.0, 1.0, 4.0, 40};
  torch::Tensor g = rope_inverse_frequencies(4, 10.0, m);
  const double f1 = 1.0 / std::sqrt(10.0);
  const double smooth = (40.0 / (2 * M_PI / f1) - 1.0) / 3.0;
  EXPECT_NEAR(g[1].item<double>(), (1 - smooth) * f1 / 8 + smooth * f1, 1e-7);
  EXPECT_NEAR(g[0].item<double>(), 1.0, 1e-7);
  // Unscaled.
  torch::Tensor plain = rope_inverse_frequencies(8, 10000.0, std::nullopt);
  EXPECT_NEAR(plain[3].item<double>(), 0.001, 1e-9);
  EXPECT_THROW(rope_inverse_frequencies(7, 10000.0, std::nullopt), loom::Error);
}

TEST(Rope, RotatesHalvesLikeComplexMultiplication) {
  torch::manual_seed(1);
  const int64_t d = 8;
  torch::Tensor f = rope_inverse_frequencies(d, 100.0, std::nullopt);
  torch::Tensor cache = rope_cache(f, 16);
  torch::Tensor x = torch::randn({2, 5, 3, d});
  torch::Tensor y = apply_rotary_embedding(x, cache);
  // Reference: pair (i, i + d/2) as a complex number, multiplied by exp(i * p * f_i).
  torch::Tensor z = torch::complex(x.narrow(-1, 0, d / 2), x.narrow(-1, d / 2, d / 2));
  torch::Tensor angle = torch::outer(torch::arange(5, kCpu), f).view({5, 1, d / 2});
  torch::Tensor rotated = z * torch::polar(torch::ones_like(angle), angle);
  torch::Tensor ref = torch::cat({torch::real(rotated), torch::imag(rotated)}, -1);
  EXPECT_TRUE(torch::allclose(y, ref, 1e-5, 1e-6));
  // Position 0 is the identity; norms are preserved.
  EXPECT_TRUE(torch::allclose(y.select(1, 0), x.select(1, 0)));
  EXPECT_TRUE(torch::allclose(y.norm(2, -1), x.norm(2, -1), 1e-5, 1e-5));
  EXPECT_THROW(apply_rotary_embedding(torch::randn({1, 17, 1, d}), cache), loom::Error);
}

TEST(Attention, GroupedQueryMatchesExplicitCausalSoftmax) {
  torch::manual_seed(2);
  const int64_t dim = 32, heads = 4, kv = 2, hd = 8, B = 2, T = 6;
  Attention attn(dim, heads, kv, kCpu);
  for (auto& p : attn.named_parameters()) {
    attn.set_parameter(p.name, torch::randn(p.tensor().sizes()) * 0.2);
  }
  torch::Tensor cache = rope_cache(rope_inverse_frequencies(hd, 10000.0, std::nullopt), T);
  torch::Tensor x = torch::randn({B, T, dim});
  torch::Tensor y = attn.forward(x, cache);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{B, T, dim}));

  auto [q, k, v] = attn.project_qkv(x);
  q = apply_rotary_embedding(q, cache).transpose(1, 2);  // [B, H, T, D]
  k = apply_rotary_embedding(k, cache).transpose(1, 2).repeat_interleave(heads / kv, 1);
  v = v.transpose(1, 2).repeat_interleave(heads / kv, 1);
  torch::Tensor scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(double(hd));
  torch::Tensor mask = torch::ones({T, T}, torch::kBool).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  torch::Tensor out = torch::matmul(torch::softmax(scores, -1), v).transpose(1, 2).reshape({B, T, dim});
  EXPECT_TRUE(torch::allclose(y, attn.wo().forward(out), 1e-4, 1e-5));
  EXPECT_THROW(Attention(30, 4, 2, kCpu), loom::Error);
  EXPECT_THROW(Attention(32, 4, 3, kCpu), loom::Error);
}

}  // namespace
