// Transformer::forward_loss (fused norm + head + cross-entropy) against forward() followed by
// cross_entropy on the materialised logits: same loss and same gradient for every parameter.
#include <gtest/gtest.h>

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
