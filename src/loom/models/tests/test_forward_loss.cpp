// Transformer::forward_loss (fused norm + head + cross-entropy) against forward() followed by
// cross_entropy on the materialised logits: same loss and same gradient for every parameter.
#include <gtest/gtest.h>

#include <cstdio>

#include <ATen/autocast_mode.h>

#include "loom/core/error.h"
#include "loom/models/llama3/model.h"

namespace {
using namespace loom::llama3;

std::shared_ptr<Transformer> small_model() {
  ModelArgs a;
  a.dim = 64;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.vocab_size = 131;
  a.multiple_of = 32;
  a.rope_theta = 10000.0;
  a.max_seq_len = 32;
  auto model = std::make_shared<Transformer>(a);
  model->init_weights(7);
  return model;
}

std::map<std::string, torch::Tensor> grads(Transformer& model) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : model.named_parameters()) out[p.name] = p.tensor().grad().clone();
  return out;
}

TEST(ForwardLoss, EqualsCrossEntropyOfForwardLogitsWithGradients) {
  // fp32: loss rtol 1e-5, parameter gradients rtol 1e-4 / atol 1e-6.
  auto model = small_model();
  torch::manual_seed(3);
  const torch::Tensor tokens = torch::randint(0, 131, {3, 20}, torch::kInt64);
  torch::Tensor labels = torch::randint(0, 131, {3, 20}, torch::kInt64);
  labels[1][5] = -100;  // ignored, as packing would mark padding

  model->zero_grad();
  const torch::Tensor fused = model->forward_loss(tokens, labels);
  fused.backward();
  const auto g_fused = grads(*model);

  model->zero_grad();
  const torch::Tensor logits = model->forward(tokens);
  const torch::Tensor reference =
      torch::nn::functional::cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1));
  reference.backward();
  const auto g_ref = grads(*model);

  EXPECT_NEAR(fused.item<double>(), reference.item<double>(), 1e-5 * reference.item<double>());
  for (const auto& [name, g] : g_ref) {
    const torch::Tensor excess = (g_fused.at(name) - g).abs() - (1e-6 + 1e-4 * g.abs());
    EXPECT_LE(excess.max().item<double>(), 0.0)
        << name << ": max |diff| " << (g_fused.at(name) - g).abs().max().item<double>();
  }
}

TEST(ForwardLoss, Bf16AutocastTrainsThroughTheChunkedHead) {
  // CPU bf16 autocast, as a bf16 training step would run it: the linears (and the output head,
  // which forward_loss fuses with the loss: nn::fused_linear_cross_entropy's generic path) compute
  // in bf16, norms and the residual stream stay fp32, and every fp32 parameter gets an fp32
  // gradient. The loss is within 2% of the fp32 one, and each gradient points the fp32 way
  // (cosine > 0.99).
  auto model = small_model();
  torch::manual_seed(4);
  const torch::Tensor tokens = torch::randint(0, 131, {2, 24}, torch::kInt64);
  torch::Tensor labels = torch::randint(0, 131, {2, 24}, torch::kInt64);
  labels[0][3] = -100;

  model->zero_grad();
  const torch::Tensor fp32 = model->forward_loss(tokens, labels);
  fp32.backward();
  const auto g_fp32 = grads(*model);

  model->zero_grad();
  at::autocast::set_autocast_dtype(at::kCPU, torch::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  const torch::Tensor bf16 = model->forward_loss(tokens, labels);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  bf16.backward();
  const auto g_bf16 = grads(*model);

  ASSERT_EQ(bf16.scalar_type(), torch::kFloat32);
  EXPECT_NE(bf16.item<double>(), fp32.item<double>());  // autocast really ran in bf16
  EXPECT_NEAR(bf16.item<double>(), fp32.item<double>(), 0.02 * fp32.item<double>());
  for (const auto& [name, g] : g_fp32) {
    const torch::Tensor gb = g_bf16.at(name);
    ASSERT_EQ(gb.scalar_type(), torch::kFloat32) << name;
    ASSERT_TRUE(torch::isfinite(gb).all().item<bool>()) << name;
    const double cosine =
        (gb * g).sum().item<double>() / (gb.norm().item<double>() * g.norm().item<double>());
    EXPECT_GT(cosine, 0.99) << name;
  }
}

TEST(ForwardLoss, MismatchedLabelsAreOneLineError) {
  auto model = small_model();
  const torch::Tensor tokens = torch::zeros({2, 8}, torch::kInt64);
  try {
    model->forward_loss(tokens, torch::zeros({2, 7}, torch::kInt64));
    FAIL() << "expected loom::Error";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("do not match tokens"), std::string::npos) << e.what();
  }
}

}  // namespace

// Block-causal attention (documents packed into one row): a token's loss depends only on its own
// document. Row = [doc A | doc B]; the per-token losses of B are those of B run as its own row, and
// changing A's tokens leaves them unchanged (so the row's mean over B equals B's own loss).
TEST(ForwardLoss, BlockCausalKeepsDocumentsApart) {
  auto model = small_model();
  torch::NoGradGuard no_grad;
  // A fixed draw: how far plain causal attention moves B's mean loss depends on the tokens (from
  // ~1e-5 to ~1e-3 with these small initial weights), and the check below needs a clear margin.
  torch::manual_seed(11);
  const torch::Tensor a = torch::randint(1, 131, {1, 10}), b = torch::randint(1, 131, {1, 14});
  const torch::Tensor row = torch::cat({a, b}, 1);
  const torch::Tensor docs = torch::cat({torch::zeros({1, 10}, torch::kInt64), torch::ones({1, 14}, torch::kInt64)}, 1);
  // Labels only on B (ignore_index elsewhere): the loss is B's mean next-token loss.
  torch::Tensor labels = torch::full({1, 24}, -100, torch::kInt64);
  labels.narrow(1, 10, 13).copy_(row.narrow(1, 11, 13));
  const double packed = model->forward_loss(row, labels, {torch::Tensor(), docs}).item<double>();
  torch::Tensor own_labels = torch::full({1, 14}, -100, torch::kInt64);
  own_labels.narrow(1, 0, 13).copy_(b.narrow(1, 1, 13));
  const double alone = model->forward_loss(b, own_labels).item<double>();
  EXPECT_NEAR(packed, alone, 1e-6 * alone);
  // Another document A': B's loss does not move; with plain causal attention it does.
  const torch::Tensor other = torch::cat({torch::randint(1, 131, {1, 10}), b}, 1);
  EXPECT_NEAR(model->forward_loss(other, labels, {torch::Tensor(), docs}).item<double>(), packed, 1e-6 * packed);
  const double causal_shift =
      std::abs(model->forward_loss(other, labels).item<double>() - model->forward_loss(row, labels).item<double>());
  std::printf("plain causal attention: B's loss moves by %.3e when A changes\n", causal_shift);
  EXPECT_GT(causal_shift, 1e-4);
}
