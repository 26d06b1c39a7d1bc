// The key/value-cached generation path (llama3/generate.h): each cached forward's logits equal
// the full model's at that position, and the sampler's filters do what they say.
#include <gtest/gtest.h>

#include <cstdio>

#include "loom/models/common/generate.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/model.h"

namespace {
using namespace loom;

llama3::ModelArgs generate_test_args() {
  llama3::ModelArgs a;
  a.dim = 64, a.n_layers = 2, a.n_heads = 8, a.n_kv_heads = 2, a.vocab_size = 97;
  a.multiple_of = 32, a.max_seq_len = 32, a.rope_theta = 10000.0;
  return a;
}

// A decoder of TransformerBlocks with GPT-OSS's attention (the family itself comes later): layer 0
// a sliding window of 3 tokens, layer 1 full; both with sinks and biased projections.
struct SinkArgs : llama3::ModelArgs {
  nn::AttentionOptions attention_options(int64_t layer_id) const override {
    nn::AttentionOptions o = llama3::ModelArgs::attention_options(layer_id);
    o.sinks = true;
    o.bias = true;
    o.sliding_window = layer_id == 0 ? 3 : 0;
    return o;
  }
};

class SinkDecoder : public models::Decoder {
 public:
  explicit SinkDecoder(const SinkArgs& args)
      : models::Decoder("SinkDecoder", std::make_shared<const SinkArgs>(args),
                        [](int64_t id, const models::DecoderArgs& a, const torch::TensorOptions& o) {
                          return std::make_shared<models::TransformerBlock>(id, a, o);
                        },
                        torch::kFloat32),
        args_(args) {}
  nn::ParameterInit parameter_init(const std::string& name) const override {
    auto ends_with = [&](std::string_view suffix) {
      return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (ends_with(".attention.sinks")) return nn::ParameterInit::normal(1.0);
    if (ends_with(".bias")) return nn::ParameterInit::normal(0.1);
    return llama3::parameter_init(args_, name);
  }

 private:
  SinkArgs args_;
};

}  // namespace

// The cache on sliding-window + sinks layers: prefill longer than the window, a chunk whose
// window reaches into the cached prefix, then single tokens whose window drops the oldest keys;
// every step's logits equal the uncached forward's (nn/tests: that forward against an explicit
// softmax).
TEST(Generate, SlidingWindowAndSinksCachedLogitsEqualTheFullForward) {
  SinkArgs args;
  static_cast<llama3::ModelArgs&>(args) = generate_test_args();
  SinkDecoder model(args);
  auto& attention = static_cast<models::TransformerBlock&>(model.layer("0")).attention();
  ASSERT_TRUE(attention.has_sinks() && attention.has_bias());
  ASSERT_EQ(attention.sliding_window(), 3);
  ASSERT_EQ(static_cast<models::TransformerBlock&>(model.layer("1")).attention().sliding_window(), 0);
  model.init_weights(3);
  model.eval();
  const std::vector<int64_t> tokens = {1, 9, 33, 4, 70, 12, 5, 60, 8, 2, 41, 17, 90};
  torch::InferenceMode inference;
  const torch::Tensor full = model.forward(torch::tensor(tokens, torch::kInt64).unsqueeze(0)).squeeze(0);
  models::Generator generator(model, 16);
  size_t done = 0;
  double worst = 0;
  for (size_t chunk : {5u, 3u, 1u, 1u, 1u, 2u}) {
    const std::vector<int64_t> part(tokens.begin() + static_cast<long>(done), tokens.begin() + static_cast<long>(done + chunk));
    const torch::Tensor logits = generator.forward(part);
    done += chunk;
    const torch::Tensor want = full[static_cast<int64_t>(done) - 1];
    worst = std::max(worst, (logits - want).abs().max().item<double>());
    EXPECT_TRUE(torch::allclose(logits, want, 1e-5, 1e-5)) << "after " << done << " tokens";
  }
  std::printf("sliding window + sinks generation: max |cached - full| logit difference %.2e\n", worst);
  EXPECT_EQ(generator.cached(), static_cast<int64_t>(tokens.size()));
  // The windowed layer holds the last window - 1 = 2 positions, not all 13; the full one all.
  EXPECT_EQ(generator.held_positions(0), 2);
  EXPECT_EQ(generator.held_positions(1), static_cast<int64_t>(tokens.size()));
}

// The context-parallel core models::apply_cp installs hands every layer's features to ring
// attention: on one cp rank (two chunks of 8 tokens, the window of 3 cutting the blocks) the loss
// and every gradient, sinks and biases included, equal the one-process core's, with and without
// documents, for both rotate methods.
TEST(Generate, ContextParallelCoreHonoursSinksAndWindow) {
  SinkArgs args;
  static_cast<llama3::ModelArgs&>(args) = generate_test_args();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const torch::Tensor tokens = torch::randint(0, args.vocab_size, {2, 16}, gen);
  const torch::Tensor labels = torch::randint(0, args.vocab_size, {2, 16}, gen);
  nn::TokenLayout documents;
  documents.document_ids = torch::tensor({0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2}, torch::kInt64).repeat({2, 1});
  for (const nn::TokenLayout& layout : {nn::TokenLayout{}, documents}) {
    SinkDecoder plain(args);
    plain.init_weights(3);
    const torch::Tensor want = plain.forward_loss(tokens, labels, layout);
    want.backward();
    for (auto method : {cp::RotateMethod::kRing, cp::RotateMethod::kAllGather}) {
      SinkDecoder model(args);
      model.init_weights(3);
      models::apply_cp(model, distributed::Comm::single("cp", 0), method);
      const torch::Tensor loss = model.forward_loss(tokens, labels, layout);
      loss.backward();
      EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-6 * want.item<double>());
      const auto want_params = plain.named_parameters();
      const auto params = model.named_parameters();
      ASSERT_EQ(params.size(), want_params.size());
      double worst = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        const torch::Tensor& g = want_params[i].tensor().grad();
        worst = std::max(worst, (params[i].tensor().grad() - g).abs().max().item<double>() /
                                    std::max(g.abs().max().item<double>(), 1e-12));
      }
      EXPECT_LE(worst, 1e-5) << options::enum_name(method) << (layout.document_ids.defined() ? " documents" : "");
      std::printf("cp core (%s%s): loss %.7f vs %.7f, worst relative gradient difference %.2e\n",
                  std::string(options::enum_name(method)).c_str(), layout.document_ids.defined() ? ", documents" : "",
                  loss.item<double>(), want.item<double>(), worst);
    }
  }
}

// Prefill of 5 tokens, a second chunk of 3 (a masked prefix), then single tokens: every step's
// logits equal the uncached model's logits at that position.
TEST(Generate, CachedLogitsEqualTheFullForward) {
  llama3::Transformer model(generate_test_args());
  model.init_weights(3);
  model.eval();
  const std::vector<int64_t> tokens = {1, 9, 33, 4, 70, 12, 5, 60, 8, 2, 41};
  torch::InferenceMode inference;
  const torch::Tensor full = model.forward(torch::tensor(tokens, torch::kInt64).unsqueeze(0)).squeeze(0);
  models::Generator generator(model, 16);
  size_t done = 0;
  for (size_t chunk : {5u, 3u, 1u, 1u, 1u}) {
    const std::vector<int64_t> part(tokens.begin() + static_cast<long>(done), tokens.begin() + static_cast<long>(done + chunk));
    const torch::Tensor logits = generator.forward(part);
    done += chunk;
    EXPECT_TRUE(torch::allclose(logits, full[static_cast<int64_t>(done) - 1], 1e-5, 1e-5)) << "after " << done << " tokens";
  }
  EXPECT_EQ(generator.cached(), static_cast<int64_t>(tokens.size()));
}

// The generator leaves the model as it found it: plain forward works again afterwards.
TEST(Generate, RemovesTheCacheAfterwards) {
  llama3::Transformer model(generate_test_args());
  model.init_weights(3);
  torch::InferenceMode inference;
  const torch::Tensor tokens = torch::tensor({1, 2, 3, 4}, torch::kInt64).unsqueeze(0);
  const torch::Tensor before = model.forward(tokens);
  {
    models::Generator generator(model, 8);
    generator.generate({1, 2}, {.max_new_tokens = 3, .temperature = 0});
  }
  EXPECT_TRUE(torch::equal(model.forward(tokens), before));
}

TEST(Generate, SamplerFilters) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const torch::Tensor logits = torch::tensor({0.0f, 3.0f, 2.9f, -1.0f, 2.95f});
  // Greedy, top-k 1 and a tiny top-p all take the most likely token.
  EXPECT_EQ(models::sample_token(logits, {.temperature = 0}, gen), 1);
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(models::sample_token(logits, {.temperature = 1.0, .top_k = 1}, gen), 1);
    EXPECT_EQ(models::sample_token(logits, {.temperature = 1.0, .top_p = 0.01}, gen), 1);
  }
  // Top-k 3 never picks outside {1, 2, 4}; over many draws it picks all three.
  std::set<int64_t> seen;
  for (int i = 0; i < 200; ++i) seen.insert(models::sample_token(logits, {.temperature = 1.0, .top_k = 3}, gen));
  EXPECT_EQ(seen, (std::set<int64_t>{1, 2, 4}));
  // The same seed draws the same tokens.
  auto draw = [&](uint64_t seed) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int64_t> out;
    for (int i = 0; i < 16; ++i) out.push_back(models::sample_token(logits, {.temperature = 1.0}, g));
    return out;
  };
  EXPECT_EQ(draw(5), draw(5));
}

// The batched cache (rows right-aligned, padding masked by document): with prompts of 2, 6 and 4
// tokens on the sliding-window + sinks decoder, every row's logits at every step equal those of
// the row decoded alone with Generator, also after a row is dropped (keep_rows) mid-way.
TEST(Generate, BatchedRowsOfDifferentLengthsEqualEachRowAlone) {
  SinkArgs args;
  static_cast<llama3::ModelArgs&>(args) = generate_test_args();
  SinkDecoder model(args);
  model.init_weights(5);
  model.eval();
  const std::vector<std::vector<int64_t>> prompts = {{7, 3}, {1, 9, 33, 4, 70, 12}, {60, 8, 2, 41}};
  const std::vector<std::vector<int64_t>> continuations = {{5, 17, 90, 2, 11}, {40, 6, 1, 3, 8}, {22, 23, 24, 25, 26}};
  torch::InferenceMode inference;
  // Each row alone: the logits after its prompt and after each continuation token.
  std::vector<std::vector<torch::Tensor>> alone(prompts.size());
  for (size_t r = 0; r < prompts.size(); ++r) {
    models::Generator generator(model, 16);
    alone[r].push_back(generator.forward(prompts[r]));
    for (int64_t token : continuations[r]) alone[r].push_back(generator.forward({token}));
  }
  models::BatchGenerator batch(model, 3, 6 + 5, "test");
  std::vector<int64_t> rows = {0, 1, 2};
  torch::Tensor logits = batch.prefill(prompts);
  double worst = 0;
  for (size_t step = 0;; ++step) {
    ASSERT_EQ(logits.size(0), static_cast<int64_t>(rows.size()));
    for (size_t i = 0; i < rows.size(); ++i) {
      const torch::Tensor want = alone[static_cast<size_t>(rows[i])][step];
      worst = std::max(worst, (logits[static_cast<int64_t>(i)] - want).abs().max().item<double>());
      EXPECT_TRUE(torch::allclose(logits[static_cast<int64_t>(i)], want, 1e-5, 1e-5))
          << "row " << rows[i] << " step " << step;
    }
    if (step == continuations[0].size()) break;
    if (step == 2) {  // row 1 finishes: drop it
      batch.keep_rows({0, 2});
      rows = {0, 2};
    }
    std::vector<int64_t> next;
    for (int64_t r : rows) next.push_back(continuations[static_cast<size_t>(r)][step]);
    logits = batch.decode(next);
  }
  EXPECT_EQ(batch.rows(), 2);
  std::printf("batched generation (3 rows, window + sinks): max |batched - alone| logit difference %.2e\n", worst);
}
