#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/optim/adamw.h"
#include "loom/optim/clip_grad.h"

#include <map>

namespace loom::optim {
namespace {

// torch.optim.AdamW written out with plain per-tensor ops, the definition the fused and foreach
// kernels must reproduce.
struct ReferenceAdamW {
  struct State {
    torch::Tensor param, exp_avg, exp_avg_sq;
    double weight_decay;
    int64_t step = 0;
  };
  std::vector<State> states;
  AdamWOptions o;

  void step(const std::vector<torch::Tensor>& grads) {
    for (size_t i = 0; i < states.size(); ++i) {
      State& s = states[i];
      const torch::Tensor& g = grads[i];
      s.step += 1;
      s.param = s.param * (1.0 - o.lr * s.weight_decay);
      s.exp_avg = o.beta1 * s.exp_avg + (1.0 - o.beta1) * g;
      s.exp_avg_sq = o.beta2 * s.exp_avg_sq + (1.0 - o.beta2) * g * g;
      const double bias_correction1 = 1.0 - std::pow(o.beta1, s.step);
      const double bias_correction2 = 1.0 - std::pow(o.beta2, s.step);
      const torch::Tensor denom = s.exp_avg_sq.sqrt() / std::sqrt(bias_correction2) + o.eps;
      s.param = s.param - (o.lr / bias_correction1) * s.exp_avg / denom;
    }
  }
};

NamedTensors make_params(uint64_t seed) {
  torch::manual_seed(seed);
  return {{"tok_embeddings.weight", torch::randn({64, 16})},
          {"layers.0.attention_norm.weight", torch::randn({16})},
          {"layers.0.attention.wq.weight", torch::randn({16, 16})},
          {"layers.0.feed_forward.w1.bias", torch::randn({32})},
          {"output.weight", torch::randn({64, 16})}};
}

std::vector<torch::Tensor> random_grads(const NamedTensors& params) {
  std::vector<torch::Tensor> grads;
  for (const auto& [name, p] : params) grads.push_back(torch::randn_like(p));
  return grads;
}

// Splits a flat gradient list (in named-parameter order) into the optimizer's group layout.
std::vector<std::vector<torch::Tensor>> grads_by_group(const AdamW& opt, const NamedTensors& named,
                                                       const std::vector<torch::Tensor>& grads) {
  std::vector<std::vector<torch::Tensor>> out;
  for (const ParamGroup& group : opt.param_groups()) {
    auto& g = out.emplace_back();
    for (const std::string& name : group.param_names) {
      for (size_t i = 0; i < named.size(); ++i) {
        if (named[i].first == name) g.push_back(grads[i]);
      }
    }
  }
  return out;
}

class AdamWImplementations : public ::testing::TestWithParam<AdamWImplementation> {};

TEST_P(AdamWImplementations, MatchesReferenceOverTenSteps) {
  NamedTensors named = make_params(1);
  AdamWOptions options{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                       .implementation = GetParam()};
  ReferenceAdamW ref{{}, options};
  for (const auto& [name, p] : named) {
    ref.states.push_back({p.clone(), torch::zeros_like(p), torch::zeros_like(p),
                          is_weight_decayed(name, p.sizes()) ? 0.1 : 0.0});
  }
  AdamW opt(weight_decay_param_groups(named, 0.1), options);
  for (int step = 0; step < 10; ++step) {
    // A changing lr exercises set_lr between steps, as the scheduler does.
    const double lr = 1e-2 * (1.0 - 0.05 * step);
    opt.set_lr(lr);
    ref.o.lr = lr;
    const std::vector<torch::Tensor> grads = random_grads(named);
    opt.step(grads_by_group(opt, named, grads));
    ref.step(grads);
  }
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& [name, p] = named[i];
    EXPECT_LE((p - ref.states[i].param).abs().max().item<double>(), 1e-6) << name;
    const AdamWParamState& s = opt.state(name);
    EXPECT_EQ(s.step.item<double>(), 10.0);
    EXPECT_LE((s.exp_avg - ref.states[i].exp_avg).abs().max().item<double>(), 1e-6) << name;
    EXPECT_LE((s.exp_avg_sq - ref.states[i].exp_avg_sq).abs().max().item<double>(), 1e-6) << name;
  }
}

TEST_P(AdamWImplementations, FlatBufferStepEqualsPerParameterViews) {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> layout = {
      {"tok_embeddings.weight", {32, 8}}, {"layers.0.attention_norm.weight", {8}},
      {"layers.0.attention.wq.weight", {8, 8}}, {"layers.0.ffn_norm.weight", {8}},
      {"output.weight", {32, 8}}};
  int64_t total = 0;
  for (const auto& [name, shape] : layout) total += c10::multiply_integers(shape);
  torch::manual_seed(2);
  const torch::Tensor init = torch::randn({total});

  // Per-parameter optimizer over views into one flat buffer (how FSDP shards look).
  torch::Tensor flat_a = init.clone();
  torch::Tensor flat_grad_a = torch::zeros({total});
  NamedTensors views, grad_views;
  ElementRanges no_decay;
  int64_t offset = 0;
  for (const auto& [name, shape] : layout) {
    const int64_t n = c10::multiply_integers(shape);
    views.emplace_back(name, flat_a.slice(0, offset, offset + n).view(shape));
    grad_views.emplace_back(name, flat_grad_a.slice(0, offset, offset + n).view(shape));
    if (!is_weight_decayed(name, shape)) no_decay.emplace_back(offset, offset + n);
    offset += n;
  }
  AdamWOptions options{.lr = 3e-3, .implementation = GetParam()};
  AdamW per_param(weight_decay_param_groups(views, 0.1), options);

  // The same numbers through the flat overload.
  torch::Tensor flat_b = init.clone();
  FlatAdamWState flat_state = FlatAdamWState::zeros_like(flat_b);

  for (int step = 0; step < 5; ++step) {
    const torch::Tensor grad = torch::randn({total});
    flat_grad_a.copy_(grad);
    std::vector<torch::Tensor> grads;
    for (const auto& [name, g] : grad_views) grads.push_back(g);
    per_param.step(grads_by_group(per_param, views, grads));
    adamw_step_flat(flat_b, grad, flat_state, options, 0.1, no_decay);
  }
  EXPECT_TRUE(torch::equal(flat_a, flat_b));
  EXPECT_EQ(flat_state.step.item<double>(), 5.0);
  offset = 0;
  for (const auto& [name, shape] : layout) {
    const int64_t n = c10::multiply_integers(shape);
    EXPECT_TRUE(torch::equal(per_param.state(name).exp_avg.flatten(),
                             flat_state.exp_avg.slice(0, offset, offset + n)))
        << name;
    offset += n;
  }
  EXPECT_FALSE(torch::equal(flat_a, init));  // the views really updated the shared buffer
}

TEST_P(AdamWImplementations, NonContiguousTensorsMatchReference) {
  // The fused kernel indexes raw memory: a column-slice parameter and a transposed gradient must
  // still be updated correctly (the optimizer routes/copies them as needed).
  torch::manual_seed(3);
  torch::Tensor storage = torch::randn({8, 12});
  torch::Tensor column_slice = storage.slice(1, 0, 6);
  torch::Tensor dense = torch::randn({8, 6});
  ASSERT_FALSE(column_slice.is_contiguous());
  AdamWOptions options{.lr = 1e-2, .implementation = GetParam()};
  ReferenceAdamW ref{{{column_slice.clone(), torch::zeros({8, 6}), torch::zeros({8, 6}), 0.1},
                      {dense.clone(), torch::zeros({8, 6}), torch::zeros({8, 6}), 0.1}},
                     options};
  AdamW opt({single_param_group({{"slice", column_slice}, {"dense", dense}}, 0.1)}, options);
  for (int step = 0; step < 3; ++step) {
    const torch::Tensor g0 = torch::randn({6, 8}).t(), g1 = torch::randn({6, 8}).t();
    ASSERT_FALSE(g1.is_contiguous());
    opt.step({{g0, g1}});
    ref.step({g0, g1});
  }
  EXPECT_LE((column_slice - ref.states[0].param).abs().max().item<double>(), 1e-6);
  EXPECT_LE((dense - ref.states[1].param).abs().max().item<double>(), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Optim, AdamWImplementations,
                         ::testing::Values(AdamWImplementation::kFused,
                                           AdamWImplementation::kForeach),
                         [](const auto& info) { return std::string(loom::options::enum_name(info.param)); });

TEST(AdamW, WeightDecayGroupsFollowTorchTitanRule) {
  EXPECT_TRUE(is_weight_decayed("tok_embeddings.weight", {2048, 256}));
  EXPECT_TRUE(is_weight_decayed("layers.0.attention.wq.weight", {256, 256}));
  EXPECT_FALSE(is_weight_decayed("layers.0.attention_norm.weight", {256}));
  EXPECT_FALSE(is_weight_decayed("norm.weight", {256}));
  EXPECT_FALSE(is_weight_decayed("proj.bias", {4, 4}));  // every bias, whatever its rank
  EXPECT_FALSE(is_weight_decayed("bias", {4}));
  EXPECT_TRUE(is_weight_decayed("unbiased.weight", {4, 4}));

  const NamedTensors named = make_params(4);
  const std::vector<ParamGroup> groups = weight_decay_param_groups(named, 0.1);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].name, "decay");
  EXPECT_DOUBLE_EQ(groups[0].weight_decay, 0.1);
  EXPECT_EQ(groups[0].param_names,
            (std::vector<std::string>{"tok_embeddings.weight", "layers.0.attention.wq.weight",
                                      "output.weight"}));
  EXPECT_EQ(groups[1].name, "no_decay");
  EXPECT_DOUBLE_EQ(groups[1].weight_decay, 0.0);
  EXPECT_EQ(groups[1].param_names,
            (std::vector<std::string>{"layers.0.attention_norm.weight",
                                      "layers.0.feed_forward.w1.bias"}));
  EXPECT_TRUE(groups[0].params[0].is_same(named[0].second));

  // Only norm scales: the decay group is left out rather than kept empty.
  const auto only_norms = weight_decay_param_groups({{"norm.weight", torch::ones({4})}}, 0.1);
  ASSERT_EQ(only_norms.size(), 1u);
  EXPECT_EQ(only_norms[0].name, "no_decay");
}

TEST(AdamW, StateDictRoundTripContinuesBitwise) {
  NamedTensors named = make_params(5);
  AdamW opt(weight_decay_param_groups(named, 0.1), AdamWOptions{.lr = 5e-3});
  torch::manual_seed(6);
  std::vector<std::vector<torch::Tensor>> grads;
  for (int i = 0; i < 7; ++i) grads.push_back(random_grads(named));
  for (int i = 0; i < 3; ++i) opt.step(grads_by_group(opt, named, grads[i]));

  // Snapshot parameters and optimizer state after 3 steps, as a checkpoint would.
  NamedTensors resumed;
  for (const auto& [name, p] : named) resumed.emplace_back(name, p.clone());
  TensorDict saved;
  for (const auto& [key, t] : opt.state_dict()) saved.emplace(key, t.clone());
  EXPECT_EQ(saved.size(), 3 * named.size());
  EXPECT_TRUE(saved.count("output.weight.exp_avg_sq"));

  for (int i = 3; i < 7; ++i) opt.step(grads_by_group(opt, named, grads[i]));

  AdamW restored(weight_decay_param_groups(resumed, 0.1), AdamWOptions{.lr = 5e-3});
  restored.load_state_dict(saved);
  EXPECT_EQ(restored.state("output.weight").step.item<double>(), 3.0);
  for (int i = 3; i < 7; ++i) restored.step(grads_by_group(restored, resumed, grads[i]));

  for (size_t i = 0; i < named.size(); ++i) {
    EXPECT_TRUE(torch::equal(named[i].second, resumed[i].second)) << named[i].first;
  }
  const TensorDict a = opt.state_dict(), b = restored.state_dict();
  for (const auto& [key, t] : a) EXPECT_TRUE(torch::equal(t, b.at(key))) << key;
}

TEST(AdamW, LoadStateDictRejectsMismatchedCheckpoints) {
  NamedTensors named = make_params(7);
  AdamW opt(weight_decay_param_groups(named, 0.1), AdamWOptions{});
  TensorDict state;
  for (const auto& [key, t] : opt.state_dict()) state.emplace(key, t.clone());

  TensorDict missing = state;
  missing.erase("output.weight.exp_avg");
  try {
    opt.load_state_dict(missing);
    FAIL() << "missing entry accepted";
  } catch (const loom::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "AdamW checkpoint is missing entry 'output.weight.exp_avg'; it was saved for a "
              "different optimizer, model or parameter set");
  }
  TensorDict extra = state;
  extra.emplace("ghost.weight.exp_avg", torch::zeros({1}));
  EXPECT_THROW(opt.load_state_dict(extra), loom::Error);
  TensorDict reshaped = state;
  reshaped["output.weight.exp_avg"] = torch::zeros({16, 64});
  try {
    opt.load_state_dict(reshaped);
    FAIL() << "mis-shaped entry accepted";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is Float[16, 64] but this rank's state needs Float[64, 16]"),
              std::string::npos)
        << e.what();
  }
  // A rejected load leaves the state untouched.
  EXPECT_EQ(opt.state("tok_embeddings.weight").exp_avg.abs().sum().item<double>(), 0.0);
}

TEST(AdamW, StepReadsAutogradGradientsAndSkipsParametersWithout) {
  torch::manual_seed(8);
  torch::Tensor w = torch::randn({4, 4}, torch::requires_grad());
  torch::Tensor unused = torch::randn({4}, torch::requires_grad());
  const torch::Tensor w0 = w.detach().clone(), unused0 = unused.detach().clone();
  AdamW opt({single_param_group({{"w", w}, {"unused", unused}}, 0.0)}, AdamWOptions{.lr = 0.1});
  (w * torch::randn({4, 4})).sum().backward();
  opt.step();
  EXPECT_FALSE(torch::equal(w.detach(), w0));
  EXPECT_TRUE(torch::equal(unused.detach(), unused0));
  EXPECT_EQ(opt.state("w").step.item<double>(), 1.0);
  EXPECT_EQ(opt.state("unused").step.item<double>(), 0.0);
  opt.zero_grad();
  EXPECT_FALSE(w.grad().defined());
}

TEST(AdamW, RejectsBadConstructionAndGradients) {
  const torch::Tensor a = torch::zeros({2, 2});
  EXPECT_THROW(AdamW({single_param_group({{"a", a}, {"a", torch::zeros({2})}}, 0.0)}, {}),
               loom::Error);
  EXPECT_THROW(AdamW({single_param_group({{"a", a}, {"b", a}}, 0.0)}, {}), loom::Error);
  EXPECT_THROW(AdamW({single_param_group({{"i", torch::zeros({2}, torch::kLong)}}, 0.0)}, {}),
               loom::Error);
  EXPECT_THROW(AdamW({single_param_group({{"a", a}}, 0.0)}, AdamWOptions{.beta2 = 1.0}),
               loom::Error);
  AdamW opt({single_param_group({{"a", a}}, 0.0)}, {});
  try {
    opt.step({{torch::zeros({4})}});
    FAIL() << "mis-shaped gradient accepted";
  } catch (const loom::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "gradient of 'a' has shape [4] but the parameter has shape [2, 2]");
  }
  EXPECT_THROW(opt.step({{torch::zeros({2, 2}, torch::kDouble)}}), loom::Error);
  try {
    loom::options::parse_enum<AdamWImplementation>("for-loop", "optimizer.implementation");
    FAIL() << "unknown implementation accepted";
  } catch (const loom::UsageError& e) {
    EXPECT_EQ(e.exit_code(), loom::kExitUsage);
  }
}

// The device-side guard (StepGuard): the clipping coefficient folded into the update as a gradient
// divisor, and a non-finite step skipped without a host read.
TEST(StepGuard, ClipAndSkipGuardValues) {
  const auto guard = [](double norm, double loss) {
    const StepGuard g = clip_and_skip_guard(torch::tensor(norm), torch::tensor(loss, torch::kDouble), 1.0);
    EXPECT_EQ(g.grad_scale.scalar_type(), torch::kFloat);
    EXPECT_EQ(g.found_inf.scalar_type(), torch::kFloat);
    return std::make_pair(g.grad_scale.item<float>(), g.found_inf.item<float>());
  };
  EXPECT_EQ(guard(0.5, 3.0), std::make_pair(1.0f, 0.0f));  // no clipping: exactly 1
  const auto [scale, inf] = guard(4.0, 3.0);
  EXPECT_NEAR(scale, 4.0f, 1e-5f);  // 1 / (1 / (4 + 1e-6))
  EXPECT_EQ(inf, 0.0f);
  EXPECT_EQ(guard(std::nan(""), 3.0).second, 1.0f);
  EXPECT_EQ(guard(INFINITY, 3.0).second, 1.0f);
  EXPECT_EQ(guard(0.5, INFINITY).second, 1.0f);
  EXPECT_EQ(guard(0.5, std::nan("")).second, 1.0f);
  // max_norm = 0: no clipping (scale exactly 1 whatever the norm); the non-finite check still holds.
  const StepGuard off = clip_and_skip_guard(torch::tensor(40.0), torch::tensor(1.0), 0.0);
  EXPECT_EQ(off.grad_scale.item<float>(), 1.0f);
  EXPECT_EQ(off.found_inf.item<float>(), 0.0f);
  EXPECT_EQ(clip_and_skip_guard(torch::tensor(INFINITY), torch::tensor(1.0), 0.0).found_inf.item<float>(), 1.0f);
  EXPECT_THROW(clip_and_skip_guard(torch::tensor(1.0), torch::tensor(1.0), -1.0), loom::Error);
}

// A guarded step equals clip_grads_with_norm_ + step: bitwise when nothing is clipped (the divisor is
// exactly 1), within float32 rounding of the clipped gradient when it is (g / (1/c) vs g * c).
TEST_P(AdamWImplementations, GuardedStepEqualsClippedStep) {
  for (const double max_norm : {1e9, 0.5}) {
    // The same parameters and gradients three ways: clipped then stepped, guarded, and unclipped.
    NamedTensors clipped_params = make_params(3), guarded_params = make_params(3), raw_params = make_params(3);
    AdamWOptions options{.lr = 1e-2, .implementation = GetParam()};
    AdamW clipped(weight_decay_param_groups(clipped_params, 0.1), options);
    AdamW guarded(weight_decay_param_groups(guarded_params, 0.1), options);
    AdamW raw(weight_decay_param_groups(raw_params, 0.1), options);
    torch::manual_seed(4);
    for (int step = 0; step < 4; ++step) {
      const std::vector<torch::Tensor> grads = random_grads(clipped_params);
      std::vector<torch::Tensor> to_clip;
      for (const auto& g : grads) to_clip.push_back(g.clone());
      const torch::Tensor norm = total_grad_norm(grads);
      clip_grads_with_norm_(to_clip, max_norm, norm);
      clipped.step(grads_by_group(clipped, clipped_params, to_clip));
      std::vector<torch::Tensor> raw_grads;
      for (const auto& g : grads) raw_grads.push_back(g.clone());
      raw.step(grads_by_group(raw, raw_params, raw_grads));
      const StepGuard guard = clip_and_skip_guard(norm, torch::tensor(2.5), max_norm);
      guarded.step(grads_by_group(guarded, guarded_params, grads), &guard);

    }
    for (size_t i = 0; i < clipped_params.size(); ++i) {
      const std::string& name = clipped_params[i].first;
      const torch::Tensor& a = clipped_params[i].second;
      const torch::Tensor& b = guarded_params[i].second;
      if (max_norm > 1e8) {
        EXPECT_TRUE(torch::equal(a, b)) << name << " (no clipping: bitwise)";
      } else {
        EXPECT_TRUE(torch::allclose(a, b, /*rtol=*/1e-5, /*atol=*/1e-6)) << name;
        // (Adam's update barely moves under a constant gradient scale; its first moment does.)
        EXPECT_FALSE(torch::allclose(clipped.state(name).exp_avg, raw.state(name).exp_avg)) << name << ": nothing clipped";
      }
      EXPECT_TRUE(torch::equal(clipped.state(name).step, guarded.state(name).step)) << name;
    }
  }
}

// found_inf = 1: parameters, moments and step counts stay exactly as they were, in AdamW and in the
// flat-shard step (with no-decay ranges), and the next finite step continues from there.
TEST_P(AdamWImplementations, GuardFoundInfSkipsTheWholeStep) {
  NamedTensors named = make_params(5);
  AdamWOptions options{.lr = 1e-2, .implementation = GetParam()};
  AdamW opt(weight_decay_param_groups(named, 0.1), options);
  opt.step(grads_by_group(opt, named, random_grads(named)));
  std::vector<torch::Tensor> before;
  for (const auto& [name, p] : named) before.push_back(p.clone());
  const TensorDict state = opt.state_dict();
  std::map<std::string, torch::Tensor> state_before;
  for (const auto& [k, v] : state) state_before[k] = v.clone();
  StepGuard skip{torch::tensor(1.0f), torch::tensor(1.0f)};
  std::vector<torch::Tensor> nan_grads;
  for (const auto& [name, p] : named) nan_grads.push_back(torch::full_like(p, std::nanf("")));
  opt.step(grads_by_group(opt, named, nan_grads), &skip);
  for (size_t i = 0; i < named.size(); ++i) EXPECT_TRUE(torch::equal(named[i].second, before[i])) << named[i].first;
  for (const auto& [k, v] : opt.state_dict()) EXPECT_TRUE(torch::equal(v, state_before[k])) << k;

  torch::Tensor flat = torch::randn({40});
  FlatAdamWState fs = FlatAdamWState::zeros_like(flat);
  const torch::Tensor flat_before = flat.clone();
  adamw_step_flat(flat, torch::full({40}, std::nanf("")), fs, options, 0.1, {{4, 8}, {20, 24}}, &skip);
  EXPECT_TRUE(torch::equal(flat, flat_before));
  EXPECT_EQ(fs.step.item<float>(), 0.0f);
  EXPECT_EQ(fs.exp_avg.abs().sum().item<float>(), 0.0f);
  StepGuard pass{torch::tensor(1.0f), torch::tensor(0.0f)};
  adamw_step_flat(flat, torch::ones({40}), fs, options, 0.1, {{4, 8}, {20, 24}}, &pass);
  EXPECT_EQ(fs.step.item<float>(), 1.0f);
  EXPECT_FALSE(torch::equal(flat, flat_before));
  EXPECT_THROW(adamw_step_flat(flat, torch::ones({40}), fs, options, 0.1, {},
                               &(const StepGuard&)StepGuard{torch::tensor(1.0, torch::kDouble), torch::tensor(0.0, torch::kDouble)}),
               loom::Error);  // float64 guard tensors: refused
}

}  // namespace
}  // namespace loom::optim
