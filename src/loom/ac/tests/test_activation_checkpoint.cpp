// Activation checkpointing on blocks built from loom::nn's layers the way llama3's TransformerBlock
// is (x + attn(norm(x)), then + ffn(norm(.))): every mode gives the block's output and every
// gradient bitwise equal to no checkpointing (deterministic CPU kernels, one thread), the block's
// own hooks run once, its inner modules' hooks run again in the recompute, and the memory kept from
// forward to backward drops.
#include <gtest/gtest.h>

#include <map>

#include "loom/ac/activation_checkpoint.h"
#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/nn/rope.h"

namespace {

using loom::ac::ACOptions;
using loom::ac::Mode;
namespace nn = loom::nn;

constexpr int64_t kDim = 64, kHeads = 4, kKvHeads = 2, kHidden = 160;

class Block : public nn::Module {
 public:
  explicit Block(const nn::AttentionOptions& variant = {}) : nn::Module("Block") {
    const auto options = torch::TensorOptions().dtype(torch::kFloat32);
    norm1_ = register_module("attention_norm", std::make_shared<nn::RMSNorm>(kDim, 1e-5, options));
    attention_ = register_module("attention",
                                 std::make_shared<nn::Attention>(kDim, kHeads, kKvHeads, options, variant));
    norm2_ = register_module("ffn_norm", std::make_shared<nn::RMSNorm>(kDim, 1e-5, options));
    ffn_ = register_module("feed_forward", std::make_shared<nn::FeedForward>(kDim, kHidden, options));
  }
  // By value, as TransformerBlock: the around-hook may re-run the forward after this returns.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope, const nn::TokenLayout& layout) {
    return call_with_hooks(x, [this, rope, layout](const torch::Tensor& in) {
      torch::Tensor h = in + attention_->forward(norm1_->forward(in), rope, layout);
      return h + ffn_->forward(norm2_->forward(h));
    });
  }
  nn::Attention& attention() { return *attention_; }

 private:
  std::shared_ptr<nn::RMSNorm> norm1_;
  std::shared_ptr<nn::Attention> attention_;
  std::shared_ptr<nn::RMSNorm> norm2_;
  std::shared_ptr<nn::FeedForward> ffn_;
};

struct Stack {
  std::vector<std::shared_ptr<Block>> blocks;
  torch::Tensor rope;

  // `variants`: block i's attention options (GPT-OSS's sinks, window, biases), default plain.
  explicit Stack(int n, const std::vector<nn::AttentionOptions>& variants = {}) {
    torch::manual_seed(7);
    for (int i = 0; i < n; ++i) {
      auto b = std::make_shared<Block>(variants.empty() ? nn::AttentionOptions{} : variants[i]);
      for (const auto& p : b->named_parameters()) {
        torch::NoGradGuard no_grad;
        if (p.name.find("sinks") != std::string::npos) {
          p.slot->tensor.normal_(0, 1.0);
        } else if (p.name.find("norm") != std::string::npos) {
          p.slot->tensor.uniform_(0.5, 1.5);
        } else {
          p.slot->tensor.normal_(0, 0.08);
        }
      }
      blocks.push_back(b);
    }
    rope = nn::rope_cache(nn::rope_inverse_frequencies(kDim / kHeads, 10000.0, std::nullopt), 512);
  }
  // AC as llama3's plan applies it: block i wrapped when options.wraps(i).
  void apply(const ACOptions& o) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (o.wraps(static_cast<int64_t>(i))) loom::ac::checkpoint_module(*blocks[i], o.per_op);
    }
  }
  torch::Tensor forward(torch::Tensor x, const nn::TokenLayout& layout = {}) {
    for (auto& b : blocks) x = b->forward(x, rope, layout);
    return x;
  }
  std::map<std::string, torch::Tensor> grads() {
    std::map<std::string, torch::Tensor> out;
    for (size_t i = 0; i < blocks.size(); ++i) {
      for (const auto& p : blocks[i]->named_parameters()) {
        out[std::to_string(i) + "." + p.name] = p.tensor().grad().clone();
      }
    }
    return out;
  }
};

struct Result {
  torch::Tensor output, input_grad;
  std::map<std::string, torch::Tensor> grads;
};

// Forward, a loss that weights every output element differently, backward.
Result run(const ACOptions& o, const nn::TokenLayout& layout = {}, int64_t batch = 2, int64_t seq = 24,
           const std::vector<nn::AttentionOptions>& variants = {}) {
  Stack stack(3, variants);
  stack.apply(o);
  torch::manual_seed(11);
  torch::Tensor x = torch::randn({batch, seq, kDim}).requires_grad_(true);
  torch::Tensor w = torch::randn({batch, seq, kDim});
  torch::Tensor out = stack.forward(x, layout);
  (out * w).sum().backward();
  return {out.detach(), x.grad(), stack.grads()};
}

void expect_bitwise(const Result& want, const Result& got, const std::string& what) {
  EXPECT_TRUE(torch::equal(want.output, got.output)) << what << ": output";
  EXPECT_TRUE(torch::equal(want.input_grad, got.input_grad)) << what << ": input gradient";
  ASSERT_EQ(want.grads.size(), got.grads.size()) << what;
  for (const auto& [name, g] : want.grads) {
    ASSERT_TRUE(got.grads.at(name).defined()) << what << ": " << name;
    EXPECT_TRUE(torch::equal(g, got.grads.at(name)))
        << what << ": gradient of " << name << " differs by " << (g - got.grads.at(name)).abs().max().item<double>();
  }
}

std::vector<std::pair<std::string, ACOptions>> modes() {
  return {{"full", ACOptions::from({Mode::kFull, ""})},
          {"selective 2", ACOptions::from({Mode::kSelective, "2"})},
          {"selective 1", ACOptions::from({Mode::kSelective, "1"})},
          {"selective op", ACOptions::from({Mode::kSelective, "op"})}};
}

TEST(ActivationCheckpoint, EveryModeGivesBitwiseTheOutputAndGradientsOfNoCheckpointing) {
  torch::set_num_threads(1);
  const Result want = run(ACOptions{});
  for (const auto& [name, o] : modes()) expect_bitwise(want, run(o), name);
}

TEST(ActivationCheckpoint, BlockCausalAttentionToo) {
  torch::set_num_threads(1);
  nn::TokenLayout layout;
  layout.document_ids = torch::tensor({0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2}, torch::kInt64).repeat({2, 1});
  const Result want = run(ACOptions{}, layout, 2, 16);
  for (const auto& [name, o] : modes()) expect_bitwise(want, run(o, layout, 2, 16), name + " block-causal");
}

// GPT-OSS's attention: sinks (a parameter the per-op replay must give its gradient), sliding
// windows shorter than the row and biased projections, with documents; every mode bitwise equal.
TEST(ActivationCheckpoint, BlockCausalWithSinksAndSlidingWindowToo) {
  torch::set_num_threads(1);
  nn::AttentionOptions windowed, full, window_only;
  windowed.sinks = true, windowed.sliding_window = 5, windowed.bias = true;
  full.sinks = true, full.bias = true;
  window_only.sliding_window = 3;
  const std::vector<nn::AttentionOptions> variants = {windowed, full, window_only};
  nn::TokenLayout layout;
  layout.document_ids = torch::tensor({0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2}, torch::kInt64).repeat({2, 1});
  for (bool documents : {false, true}) {
    const nn::TokenLayout l = documents ? layout : nn::TokenLayout{};
    const Result want = run(ACOptions{}, l, 2, 16, variants);
    ASSERT_TRUE(want.grads.count("0.attention.sinks") && want.grads.count("1.attention.sinks") &&
                want.grads.count("0.attention.wo.bias") && !want.grads.count("2.attention.sinks"));
    EXPECT_GT(want.grads.at("0.attention.sinks").abs().min().item<double>(), 0);
    for (const auto& [name, o] : modes()) {
      expect_bitwise(want, run(o, l, 2, 16, variants), name + (documents ? " block-causal" : " causal") + " sinks+window");
    }
  }
}

// Mixed precision without FSDP is autocast around the forward only (the Trainer's scope ends
// before backward): the recompute must run under the forward's autocast state, or its matmuls
// would be float32 and the gradients would differ.
TEST(ActivationCheckpoint, RecomputeRunsUnderTheForwardsAutocast) {
  torch::set_num_threads(1);
  auto run_bf16 = [](const ACOptions& o) {
    Stack stack(2);
    stack.apply(o);
    torch::manual_seed(11);
    torch::Tensor x = torch::randn({2, 16, kDim}).requires_grad_(true);
    torch::Tensor out;
    {
      loom::AutocastScope autocast(c10::kCPU, torch::kBFloat16);
      out = stack.forward(x);
    }
    out.square().sum().backward();
    return Result{out.detach(), x.grad(), stack.grads()};
  };
  const Result want = run_bf16(ACOptions{});
  // Autocast was on: the float32 forward gives other values (the residual stream is float32, the
  // projections' outputs bfloat16).
  EXPECT_FALSE(torch::equal(want.output, [] {
    Stack stack(2);
    torch::manual_seed(11);
    torch::NoGradGuard no_grad;
    return stack.forward(torch::randn({2, 16, kDim}));
  }()));
  for (const auto& [name, o] : modes()) expect_bitwise(want, run_bf16(o), name + " under bf16 autocast");
}

// Two forwards before their backwards (gradient accumulation, a pipeline stage's 1F1B): each
// call's recompute uses its own saved state, in any backward order.
TEST(ActivationCheckpoint, SeveralForwardsOutstandingBeforeTheirBackwards) {
  torch::set_num_threads(1);
  for (const auto& [name, o] : modes()) {
    std::map<std::string, torch::Tensor> want, got;
    for (bool checkpointed : {false, true}) {
      Stack stack(2);
      if (checkpointed) stack.apply(o);
      torch::manual_seed(3);
      torch::Tensor a = torch::randn({1, 16, kDim}), b = torch::randn({1, 16, kDim});
      torch::Tensor la = stack.forward(a.requires_grad_(true)).square().sum();
      torch::Tensor lb = stack.forward(b.requires_grad_(true)).sin().sum();
      lb.backward();  // the later micro-batch first
      la.backward();
      (checkpointed ? got : want) = stack.grads();
      (checkpointed ? got : want)["a"] = a.grad();
      (checkpointed ? got : want)["b"] = b.grad();
    }
    for (const auto& [k, g] : want) {
      // Two backwards accumulate into the same .grad in the same order either way: bitwise too.
      EXPECT_TRUE(torch::equal(g, got.at(k))) << name << ": " << k;
    }
  }
}

// The block's own hooks (where FSDP all-gathers, reshards and registers its pre-backward hook)
// run once per forward, not again in the recompute; hooks of modules inside the block (tensor
// parallel's collectives) run in the recompute too.
TEST(ActivationCheckpoint, BlockHooksRunOnceInnerHooksRunAgain) {
  for (const auto& [name, o] : modes()) {
    Stack stack(1);
    Block& block = *stack.blocks[0];
    int block_pre = 0, block_post = 0, inner_pre = 0, output_hooks = 0;
    block.add_forward_pre_hook([&](nn::Module&, torch::Tensor x) {
      ++block_pre;
      return x;
    });
    block.add_forward_post_hook([&](nn::Module&, torch::Tensor, torch::Tensor y) {
      ++block_post;
      if (y.requires_grad()) y.register_hook([&](const torch::Tensor&) { ++output_hooks; });
      return y;
    });
    block.attention().add_forward_pre_hook([&](nn::Module&, torch::Tensor x) {
      ++inner_pre;
      return x;
    });
    stack.apply(o);
    torch::Tensor x = torch::randn({1, 8, kDim}, torch::requires_grad());
    stack.forward(x).sum().backward();
    EXPECT_EQ(block_pre, 1) << name;
    EXPECT_EQ(block_post, 1) << name;
    EXPECT_EQ(output_hooks, 1) << name;
    // Selective every 2nd block leaves block 0 alone: no recompute there.
    EXPECT_EQ(inner_pre, o.wraps(0) ? 2 : 1) << name << ": forward and recompute";
  }
}

// A pipeline stage's split backward through autograd: I = grad(loss, input, retain_graph), which
// must accumulate no parameter gradient, then W = backward(loss, inputs = parameters), which must
// accumulate each exactly once (the checkpoint node runs in both passes).
TEST(ActivationCheckpoint, SplitBackwardAccumulatesEachGradientOnce) {
  torch::set_num_threads(1);
  for (const auto& [name, o] : modes()) {
    std::map<std::string, torch::Tensor> want, got;
    for (bool checkpointed : {false, true}) {
      Stack stack(2);
      if (checkpointed) stack.apply(o);
      torch::manual_seed(4);
      torch::Tensor x = torch::randn({1, 12, kDim}).requires_grad_(true);
      torch::Tensor loss = stack.forward(x).square().sum();
      const torch::Tensor gx = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true)[0];
      std::vector<torch::Tensor> params;
      for (auto& b : stack.blocks) {
        for (const auto& p : b->named_parameters()) {
          EXPECT_FALSE(p.tensor().grad().defined()) << name << ": I accumulated " << p.name;
          params.push_back(p.tensor());
        }
      }
      torch::autograd::backward({loss}, {}, /*retain_graph=*/false, /*create_graph=*/false, params);
      auto& into = checkpointed ? got : want;
      into = stack.grads();
      into["x"] = gx;
    }
    for (const auto& [k, g] : want) EXPECT_TRUE(torch::equal(g, got.at(k))) << name << ": " << k;
  }
}

// The parameters get their gradients even when the block's input needs none (the first block of
// a model whose embedding is frozen, a pipeline stage fed a tensor without history).
TEST(ActivationCheckpoint, InputWithoutGradientStillTrainsTheParameters) {
  for (const auto& [name, o] : modes()) {
    Stack stack(1);
    stack.apply(o);
    stack.forward(torch::randn({1, 8, kDim})).sum().backward();
    for (const auto& p : stack.blocks[0]->named_parameters()) {
      EXPECT_TRUE(p.tensor().grad().defined()) << name << ": " << p.name;
    }
  }
}

TEST(ActivationCheckpoint, WithoutGradModeItIsThePlainForward) {
  Stack plain(2), wrapped(2);
  wrapped.apply(ACOptions::from({Mode::kSelective, "op"}));
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randn({1, 8, kDim});
  EXPECT_TRUE(torch::equal(plain.forward(x), wrapped.forward(x)));
}

// linear_replay's backward is at::linear's, bitwise, for the layouts the replay accepts.
TEST(ActivationCheckpoint, LinearReplayHasTheGradientsOfAtLinear) {
  torch::set_num_threads(1);
  torch::manual_seed(5);
  const torch::Tensor weight0 = torch::randn({48, 32});
  const std::vector<std::pair<std::string, torch::Tensor>> inputs = {
      {"3-D contiguous", torch::randn({3, 10, 32})},
      {"2-D", torch::randn({30, 32})},
      {"2-D column-major", torch::randn({32, 30}).t()},
  };
  for (const auto& [name, x0] : inputs) {
    const torch::Tensor g = torch::randn_like(at::linear(x0, weight0));
    torch::Tensor x1 = x0.detach().requires_grad_(true), w1 = weight0.clone().requires_grad_(true);
    at::linear(x1, w1).backward(g);
    torch::Tensor x2 = x0.detach().requires_grad_(true), w2 = weight0.clone().requires_grad_(true);
    ASSERT_TRUE(loom::ac::replayable_linear(x2, w2)) << name;
    const torch::Tensor y = at::linear(x0, weight0);
    torch::Tensor out = loom::ac::linear_replay(x2, w2, y);
    EXPECT_TRUE(torch::equal(out, y)) << name;
    out.backward(g);
    EXPECT_TRUE(torch::equal(x1.grad(), x2.grad())) << name;
    EXPECT_TRUE(torch::equal(w1.grad(), w2.grad())) << name;
  }
  EXPECT_FALSE(loom::ac::replayable_linear(torch::randn({4, 32, 5}).transpose(1, 2), weight0));
}

// What a forward leaves allocated for its backward, counted by the allocator (exact, unlike RSS):
// full keeps one input per block, selective every 2nd block about half of no checkpointing plus
// the inputs, per-op the matmul and attention outputs but not the norms' and SwiGLU's.
TEST(ActivationCheckpoint, SavedActivationsShrink) {
  torch::set_num_threads(1);
  const int64_t batch = 2, seq = 256, blocks = 4;
  std::map<std::string, int64_t> kept;
  std::vector<std::pair<std::string, ACOptions>> all = {{"none", ACOptions{}}};
  for (const auto& m : modes()) all.push_back(m);
  for (const auto& [name, o] : all) {
    Stack stack(blocks);
    stack.apply(o);
    const torch::Tensor x = torch::randn({batch, seq, kDim}, torch::requires_grad());
    loom::memory::AllocationTracker tracker;
    torch::Tensor out = stack.forward(x);
    kept[name] = tracker.current_bytes() - static_cast<int64_t>(out.nbytes());
    out.sum().backward();
    std::printf("%-13s kept from forward to backward: %8.3f MiB\n", name.c_str(), kept[name] / 1048576.0);
  }
  const int64_t input_bytes = batch * seq * kDim * 4;
  // Full: the block inputs (the first is the caller's, already allocated) and nothing else.
  EXPECT_LE(kept["full"], (blocks - 1) * input_bytes + 64 * 1024);
  EXPECT_LT(kept["full"], kept["selective 2"]);
  EXPECT_LT(kept["selective 2"], kept["none"]);
  EXPECT_LT(kept["selective op"], kept["none"]);
  EXPECT_LT(kept["full"], kept["selective op"]);
  EXPECT_EQ(kept["selective 1"], kept["full"]);
}

TEST(ActivationCheckpoint, OptionsParseAndBadValuesNameTheNearest) {
  EXPECT_EQ(ACOptions::from({Mode::kNone, "op"}).mode, Mode::kNone);
  const ACOptions two = ACOptions::from({Mode::kSelective, "2"});
  EXPECT_EQ(two.every, 2);
  EXPECT_FALSE(two.wraps(0));
  EXPECT_TRUE(two.wraps(1));
  EXPECT_FALSE(two.wraps(2));
  EXPECT_TRUE(two.wraps(3));
  EXPECT_TRUE(ACOptions::from({Mode::kSelective, "op"}).per_op);
  EXPECT_TRUE(ACOptions::from({Mode::kFull, ""}).wraps(5));
  auto usage = [](const std::string& mode, const std::string& option) {
    try {
      ACOptions::from({loom::options::parse_enum<Mode>(mode, "activation_checkpoint.mode"), option});
    } catch (const loom::UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(usage("ful", "2").find("(did you mean \"full\"?)"), std::string::npos) << usage("ful", "2");
  EXPECT_NE(usage("selective", "opp").find("(did you mean 'op'?)"), std::string::npos);
  EXPECT_NE(usage("selective", "0").find("is not \"op\" or a positive integer"), std::string::npos);
}

}  // namespace
