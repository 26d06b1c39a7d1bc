// The device-generic implementations of the fused ops (FusedImpl::kGeneric, ATen ops only: what
// CUDA, bf16/fp16 and autocast runs take), forced onto the CPU here, against the libtorch
// compositions; the one dispatch function that picks an implementation; and a measurement that
// the chunked output head never holds the [tokens, vocab] logits.
#include <gtest/gtest.h>

#include <ATen/autocast_mode.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "loom/core/error.h"
#include "loom/nn/fused.h"
#include "loom/testing/errors.h"
#include "loom/nn/rope.h"
#include "loom/nn/tests/fused_test_support.h"

namespace {
using loom::nn::test_support::CEResult;
using loom::nn::test_support::expect_close;
using loom::nn::test_support::run_ce;
using namespace loom::nn;




// The composition the fused head replaces: full logits, fp32 cross-entropy (as model.cpp's
// unfused branch does).
torch::Tensor reference_ce(const torch::Tensor& h, const torch::Tensor& w,
                           const torch::Tensor& labels) {
  return torch::nn::functional::cross_entropy(at::linear(h, w).to(torch::kFloat32), labels);
}

torch::Tensor generic_ce(const torch::Tensor& h, const torch::Tensor& w,
                         const torch::Tensor& labels, int64_t chunk) {
  return fused_linear_cross_entropy(h, w, labels, -100, chunk, FusedImpl::kGeneric);
}

// Enables CPU autocast to `dtype` for its lifetime, restoring the previous state.
class CpuAutocast {
 public:
  explicit CpuAutocast(c10::ScalarType dtype)
      : was_enabled_(at::autocast::is_autocast_enabled(at::kCPU)),
        old_dtype_(at::autocast::get_autocast_dtype(at::kCPU)) {
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
    at::autocast::set_autocast_enabled(at::kCPU, true);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, was_enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, old_dtype_);
    at::autocast::clear_cache();
  }

 private:
  bool was_enabled_;
  c10::ScalarType old_dtype_;
};

TEST(FusedDispatch, CpuKernelsOnlyForCpuFp32AndAutocastPicksTheHeadDtype) {
  EXPECT_EQ(fused_impl_for(torch::kCPU, torch::kFloat32), FusedImpl::kCpuFp32);
  for (auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat64}) {
    EXPECT_EQ(fused_impl_for(torch::kCPU, dtype), FusedImpl::kGeneric) << dtype;
  }
  // Only a Device value: no CUDA runtime is needed to ask.
  // CUDA: Loom's kernels where this build has them, else the ATen compositions.
  const FusedImpl cuda = cuda_kernels_built() ? FusedImpl::kCuda : FusedImpl::kGeneric;
  EXPECT_EQ(fused_impl_for(c10::Device("cuda:0"), torch::kFloat32), cuda);
  EXPECT_EQ(fused_impl_for(c10::Device("cuda:0"), torch::kBFloat16), cuda);
  EXPECT_EQ(fused_impl_for(c10::Device("cuda:0"), torch::kFloat64), FusedImpl::kGeneric);

  const torch::Tensor h32 = torch::randn({4, 8}), w32 = torch::randn({5, 8});
  const torch::Tensor h64 = h32.to(torch::kFloat64), w64 = w32.to(torch::kFloat64);
  EXPECT_EQ(linear_compute_dtype(h32, w32), torch::kFloat32);
  EXPECT_EQ(linear_compute_dtype(h32.to(torch::kBFloat16), w32), torch::kFloat32);  // promotion
  {
    CpuAutocast autocast(torch::kBFloat16);
    EXPECT_EQ(linear_compute_dtype(h32, w32), torch::kBFloat16);
    EXPECT_EQ(linear_compute_dtype(h32.to(torch::kBFloat16), w32), torch::kBFloat16);
    EXPECT_EQ(linear_compute_dtype(h64, w64), torch::kFloat64);  // autocast leaves fp64 alone
  }
  EXPECT_EQ(linear_compute_dtype(h32, w32), torch::kFloat32);
}

TEST(FusedDispatch, CudaKernelSwitchNamesEachKernelAndRejectsUnknownOnes) {
  using loom::nn::CudaKernel;
  using loom::nn::CudaKernelSet;
  using loom::nn::parse_cuda_kernels;
  EXPECT_EQ(parse_cuda_kernels("all"), CudaKernelSet::all());
  EXPECT_EQ(parse_cuda_kernels("none").bits, 0u);
  const CudaKernelSet some = parse_cuda_kernels("rope,cross_entropy");
  EXPECT_TRUE(some.has(CudaKernel::kRope));
  EXPECT_TRUE(some.has(CudaKernel::kCrossEntropy));
  EXPECT_FALSE(some.has(CudaKernel::kSwiGLU));
  EXPECT_FALSE(some.has(CudaKernel::kRmsNorm));
  EXPECT_FALSE(some.has(CudaKernel::kAdamW));
  EXPECT_EQ(parse_cuda_kernels("swiglu,rms_norm,rope,cross_entropy,adamw,add_rms_norm"),
            CudaKernelSet::all());
  EXPECT_FALSE(parse_cuda_kernels("swiglu,rms_norm,rope,cross_entropy,adamw").has(CudaKernel::kAddRmsNorm));
  EXPECT_TRUE(parse_cuda_kernels("adamw").has(CudaKernel::kAdamW));
  loom::testing::expect_error<loom::UsageError>([] { parse_cuda_kernels("swiglu,flash"); },
                                                {"training.cuda_kernels", "unknown kernel 'flash'",
                                                 "swiglu, rms_norm, rope, cross_entropy, adamw, add_rms_norm"});
  loom::testing::expect_error<loom::UsageError>([] { parse_cuda_kernels(""); },
                                                {"unknown kernel ''"});
  // Switching kernels off never changes the CPU choice.
  loom::nn::set_cuda_kernels(parse_cuda_kernels("none"));
  EXPECT_EQ(fused_impl_for(torch::kCPU, torch::kFloat32), FusedImpl::kCpuFp32);
  loom::nn::set_cuda_kernels(CudaKernelSet::all());
}

TEST(FusedDispatch, ForcingTheCpuKernelOnInputsItCannotTakeIsAnError) {
  const torch::Tensor xb = torch::randn({3, 8}, torch::kBFloat16);
  const torch::Tensor wb = torch::randn({8}, torch::kBFloat16);
  EXPECT_THROW(fused_rms_norm(xb, wb, 1e-5, FusedImpl::kCpuFp32), loom::Error);
  EXPECT_THROW(fused_swiglu(xb, xb, FusedImpl::kCpuFp32), loom::Error);
  const torch::Tensor labels = torch::zeros({3}, torch::kInt64);
  const torch::Tensor head = torch::randn({5, 8}, torch::kBFloat16);
  EXPECT_THROW(fused_linear_cross_entropy(xb, head, labels, -100, 512, FusedImpl::kCpuFp32),
               loom::Error);
  // fp32 inputs under CPU autocast compute the head in bf16: not the CPU kernel's job either.
  CpuAutocast autocast(torch::kBFloat16);
  EXPECT_THROW(fused_linear_cross_entropy(xb.to(torch::kFloat32), head.to(torch::kFloat32),
                                          labels, -100, 512, FusedImpl::kCpuFp32),
               loom::Error);
}

TEST(GenericLinearCrossEntropy, Fp32MatchesLinearPlusCrossEntropy) {
  // fp32: loss within rtol 1e-5; each gradient entry within 1e-5 of itself plus 1e-5 of the
  // gradient's largest entry (entries that cancel to ~0 in softmax - onehot carry absolute, not
  // relative, rounding: measured max |diff| ~1.5e-6 of the largest entry). Cases: ragged last
  // chunk with ignored tokens, one token, a prime vocabulary with chunk 7, chunk == N, chunk > N.
  struct Case {
    int64_t tokens, dim, vocab, chunk;
    std::vector<int64_t> ignored;
  };
  const std::vector<Case> cases = {
      {37, 48, 300, 8, {3, 17, 36}}, {1, 16, 50, 512, {}}, {50, 24, 1009, 7, {0, 49}},
      {64, 32, 257, 64, {}},         {5, 8, 11, 512, {2}},
  };
  int64_t seed = 10;
  for (const Case& c : cases) {
    torch::manual_seed(seed++);
    const std::string what = c10::str("N=", c.tokens, " V=", c.vocab, " chunk=", c.chunk);
    const torch::Tensor hidden = torch::randn({c.tokens, c.dim}) * 3;
    const torch::Tensor weight = torch::randn({c.vocab, c.dim}) * 0.5;
    torch::Tensor labels = torch::randint(0, c.vocab, {c.tokens}, torch::kInt64);
    for (int64_t i : c.ignored) labels[i] = -100;
    const CEResult a = run_ce([&](auto& h, auto& w) { return generic_ce(h, w, labels, c.chunk); },
                              hidden, weight);
    const CEResult b = run_ce([&](auto& h, auto& w) { return reference_ce(h, w, labels); },
                              hidden, weight);
    EXPECT_EQ(a.loss.scalar_type(), torch::kFloat32);
    expect_close(a.loss, b.loss, 1e-5, 0.0, what + " loss");
    expect_close(a.d_hidden, b.d_hidden, 1e-5, 1e-5 * b.d_hidden.abs().max().item<double>(),
                 what + " d_hidden");
    expect_close(a.d_weight, b.d_weight, 1e-5, 1e-5 * b.d_weight.abs().max().item<double>(),
                 what + " d_weight");
    // The CPU kernel on the same inputs agrees too (its own exp; tolerance of its own test).
    const CEResult k = run_ce(
        [&](auto& h, auto& w) {
          return fused_linear_cross_entropy(h, w, labels, -100, c.chunk, FusedImpl::kCpuFp32);
        },
        hidden, weight);
    expect_close(a.loss, k.loss, 1e-5, 0.0, what + " loss vs CPU kernel");
    expect_close(a.d_weight, k.d_weight, 1e-4, 1e-7, what + " d_weight vs CPU kernel");
  }
}

TEST(GenericLinearCrossEntropy, LowPrecisionMatchesTheCompositionInTheSameDtype) {
  // bf16 and fp16 hidden and weight: the reference is at::linear in that dtype (logits rounded to
  // it) and fp32 cross-entropy, so both sides round the logits alike; they differ in where the
  // gradient GEMMs round (per chunk here, summed in fp32). One bf16 ulp is 2^-8 ~ 3.9e-3, one fp16
  // ulp 2^-11. Tolerances: loss rtol 2e-3; gradients |diff| <= 2 ulp * |ref| + 1 ulp * max|ref|.
  // Gradients come back in the input dtype.
  for (auto dtype : {torch::kBFloat16, torch::kFloat16}) {
    const double ulp = dtype == torch::kBFloat16 ? 1.0 / 256 : 1.0 / 2048;
    torch::manual_seed(20);
    const torch::Tensor hidden = (torch::randn({45, 32}) * 2).to(dtype);
    const torch::Tensor weight = (torch::randn({301, 32}) * 0.5).to(dtype);
    torch::Tensor labels = torch::randint(0, 301, {45}, torch::kInt64);
    labels[7] = -100;
    const CEResult a =
        run_ce([&](auto& h, auto& w) { return generic_ce(h, w, labels, 16); }, hidden, weight);
    const CEResult b =
        run_ce([&](auto& h, auto& w) { return reference_ce(h, w, labels); }, hidden, weight);
    // The automatic choice for these inputs is the same generic path.
    const CEResult auto_choice = run_ce(
        [&](auto& h, auto& w) { return fused_linear_cross_entropy(h, w, labels, -100, 16); },
        hidden, weight);
    const std::string what = c10::str(dtype);
    EXPECT_TRUE(torch::equal(a.loss, auto_choice.loss)) << what;
    EXPECT_TRUE(torch::equal(a.d_weight, auto_choice.d_weight)) << what;
    ASSERT_EQ(a.d_hidden.scalar_type(), dtype);
    ASSERT_EQ(a.d_weight.scalar_type(), dtype);
    expect_close(a.loss, b.loss, 2e-3, 0.0, what + " loss");
    const double gh = b.d_hidden.abs().max().item<double>();
    const double gw = b.d_weight.abs().max().item<double>();
    expect_close(a.d_hidden, b.d_hidden, 2 * ulp, ulp * gh, what + " d_hidden");
    expect_close(a.d_weight, b.d_weight, 2 * ulp, ulp * gw, what + " d_weight");
  }
}

TEST(GenericLinearCrossEntropy, AutocastComputesInBf16WithFp32MasterGradients) {
  // fp32 hidden and an fp32 master weight under CPU bf16 autocast: the head runs in bf16, as
  // autocast would run the at::linear it replaces, and the gradients come back fp32 (the weight's
  // summed over chunks in fp32). Reference: the same composition under the same autocast.
  // Tolerances: bf16 ones of the test above (ulp 2^-8).
  const double ulp = 1.0 / 256;
  torch::manual_seed(21);
  const torch::Tensor hidden = torch::randn({40, 32}) * 2;
  const torch::Tensor weight = torch::randn({203, 32}) * 0.5;
  torch::Tensor labels = torch::randint(0, 203, {40}, torch::kInt64);
  labels[0] = -100;
  CpuAutocast autocast(torch::kBFloat16);
  const CEResult a = run_ce(
      [&](auto& h, auto& w) { return fused_linear_cross_entropy(h, w, labels, -100, 16); },
      hidden, weight);
  const CEResult b =
      run_ce([&](auto& h, auto& w) { return reference_ce(h, w, labels); }, hidden, weight);
  ASSERT_EQ(a.d_hidden.scalar_type(), torch::kFloat32);
  ASSERT_EQ(a.d_weight.scalar_type(), torch::kFloat32);
  expect_close(a.loss, b.loss, 2e-3, 0.0, "loss");
  expect_close(a.d_hidden, b.d_hidden, 2 * ulp, ulp * b.d_hidden.abs().max().item<double>(),
               "d_hidden");
  expect_close(a.d_weight, b.d_weight, 2 * ulp, ulp * b.d_weight.abs().max().item<double>(),
               "d_weight");
  // And it is not the fp32 answer: the GEMMs really ran in bf16.
  at::autocast::set_autocast_enabled(at::kCPU, false);
  const CEResult fp32 = run_ce([&](auto& h, auto& w) { return reference_ce(h, w, labels); },
                               hidden, weight);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  EXPECT_FALSE(torch::equal(a.loss, fp32.loss));
}

TEST(GenericLinearCrossEntropy, AllIgnoredNoTokensAndBadLabelsBehaveLikeTheCpuKernel) {
  torch::manual_seed(22);
  const torch::Tensor hidden = torch::randn({6, 8});
  const torch::Tensor weight = torch::randn({13, 8});
  // Every label ignored: loss 0 and zero gradients (a micro-batch of zero weight; torch's
  // cross_entropy gives nan there, which stopped SFT runs whose prompt filled a row: issue 46).
  const torch::Tensor ignored = torch::full({6}, -100, torch::kInt64);
  for (auto impl : {FusedImpl::kGeneric, FusedImpl::kCpuFp32}) {
    const CEResult a = run_ce(
        [&](auto& h, auto& w) {
          return fused_linear_cross_entropy(h, w, ignored, -100, 4, impl);
        },
        hidden, weight);
    EXPECT_EQ(a.loss.item<double>(), 0.0);
    EXPECT_TRUE(torch::equal(a.d_hidden, torch::zeros_like(hidden)));
    EXPECT_TRUE(torch::equal(a.d_weight, torch::zeros_like(weight)));
  }
  const CEResult ref = run_ce([&](auto& h, auto& w) { return reference_ce(h, w, ignored); },
                              hidden, weight);
  EXPECT_TRUE(std::isnan(ref.loss.item<double>()));
  EXPECT_TRUE(torch::equal(ref.d_weight, torch::zeros_like(weight)));

  // No tokens at all (the automatic choice takes the generic path): 0 too.
  const CEResult empty = run_ce(
      [&](auto& h, auto& w) {
        return fused_linear_cross_entropy(h, w, torch::zeros({0}, torch::kInt64));
      },
      torch::randn({0, 8}), weight);
  EXPECT_EQ(empty.loss.item<double>(), 0.0);
  EXPECT_EQ(empty.d_hidden.sizes(), (std::vector<int64_t>{0, 8}));
  EXPECT_TRUE(torch::equal(empty.d_weight, torch::zeros_like(weight)));

  // An out-of-range label is the same one-line error as the CPU kernel's, before any gather.
  const torch::Tensor bad = torch::tensor({1, 2, -100, 13, 3, -5}, torch::kInt64);
  try {
    generic_ce(hidden, weight, bad, 4);
    FAIL() << "expected loom::Error";
  } catch (const loom::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("label 13 at position 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.vocab_size"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(GenericLinearCrossEntropy, NoGradFrozenWeightAndScaledUpstreamGradient) {
  torch::manual_seed(23);
  const torch::Tensor hidden = torch::randn({10, 16});
  const torch::Tensor weight = torch::randn({50, 16});
  const torch::Tensor labels = torch::randint(0, 50, {10}, torch::kInt64);
  const torch::Tensor ref = reference_ce(hidden, weight, labels);
  {
    torch::NoGradGuard no_grad;
    expect_close(generic_ce(hidden, weight, labels, 3), ref, 1e-5, 0.0, "no-grad loss");
  }
  // Frozen weight, loss scaled by 0.25 before backward (gradient accumulation does this).
  torch::Tensor h = hidden.clone().requires_grad_(true);
  (generic_ce(h, weight, labels, 4) * 0.25).backward();
  torch::Tensor hr = hidden.clone().requires_grad_(true);
  (reference_ce(hr, weight, labels) * 0.25).backward();
  expect_close(h.grad(), hr.grad(), 1e-5, 1e-5 * hr.grad().abs().max().item<double>(), "d_hidden");
}

// ---- memory: the chunked head never holds [tokens, vocab] ----------------------------------

// Wraps the CPU allocator and keeps the live and the peak number of bytes it handed out. Every
// CPU tensor libtorch creates goes through c10::GetCPUAllocator(), so the peak of a call is
// exact and deterministic -- no RSS sampling. Its DataPtrs stay "simple" (context == data, as the
// default allocator's), which raw_allocate() -- used for BLAS scratch -- requires; the block sizes
// and the inner deleters live in a side table.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    c10::DeleterFnPtr inner_deleter = inner.get_deleter();
    TORCH_CHECK(inner.get_context() == data, "the wrapped CPU allocator is not simple");
    inner.release_context();
    State& st = state();
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      st.blocks[data] = {n, inner_deleter};
      st.live += static_cast<int64_t>(n);
      st.peak = std::max(st.peak, st.live);
    }
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // Peak bytes above the live bytes at the start of `f`.
  template <typename F>
  int64_t peak_during(F&& f) {
    State& st = state();
    int64_t base = 0;
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      base = st.peak = st.live;
    }
    f();
    std::lock_guard<std::mutex> lock(st.mutex);
    return st.peak - base;
  }

 private:
  struct Block {
    size_t bytes;
    c10::DeleterFnPtr deleter;
  };
  static void release(void* data) {
    State& st = state();
    Block b{};
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      const auto it = st.blocks.find(data);
      TORCH_CHECK(it != st.blocks.end(), "CountingCpuAllocator: freeing an unknown block");
      b = it->second;
      st.blocks.erase(it);
      st.live -= static_cast<int64_t>(b.bytes);
    }
    if (b.deleter) b.deleter(data);
  }
  // Shared by every instance and reachable from the plain-function deleter.
  struct State {
    std::mutex mutex;
    std::unordered_map<void*, Block> blocks;
    int64_t live = 0;
    int64_t peak = 0;
  };
  // Never destroyed: a tensor it allocated may be freed during static destruction.
  static State& state() {
    static auto* s = new State;
    return *s;
  }
  c10::Allocator* inner_;
};

TEST(GenericLinearCrossEntropy, PeakMemoryIsChunkSizedNotLogitsSized) {
  // N = 4096 tokens, V = 1001, chunk 128: the full fp32 logits are 16.4 MB, one chunk's 0.5 MB.
  // Forward + backward of the chunked head (generic fp32, generic bf16 and the CPU kernel) must
  // peak below a quarter of the logits -- a few chunk buffers plus the two gradients (0.5 MB and
  // 0.1 MB) -- while the composition, measured the same way, peaks above the full logits (which
  // shows the counter sees such allocations).
  constexpr int64_t kTokens = 4096, kDim = 32, kVocab = 1001, kChunk = 128;
  constexpr int64_t kLogitsBytes = kTokens * kVocab * 4;
  torch::manual_seed(24);
  const torch::Tensor hidden = torch::randn({kTokens, kDim});
  const torch::Tensor weight = torch::randn({kVocab, kDim}) * 0.3;
  const torch::Tensor labels = torch::randint(0, kVocab, {kTokens}, torch::kInt64);

  // Never destroyed: tensors it allocated may outlive the test (the deleter points back to it).
  static auto* counting = new CountingCpuAllocator(c10::GetCPUAllocator());
  c10::Allocator* previous = c10::GetCPUAllocator();
  constexpr uint8_t kPriority = 200;
  c10::SetCPUAllocator(counting, kPriority);
  ASSERT_EQ(c10::GetCPUAllocator(), counting);
  auto measure = [&](auto loss_fn, c10::ScalarType dtype) {
    // Fresh leaves made before the window; their gradients are allocated inside it and count.
    torch::Tensor h = hidden.to(dtype).detach().clone().requires_grad_(true);
    torch::Tensor w = weight.to(dtype).detach().clone().requires_grad_(true);
    return counting->peak_during([&] { loss_fn(h, w).backward(); });
  };
  const int64_t generic32 = measure(
      [&](auto& h, auto& w) { return generic_ce(h, w, labels, kChunk); }, torch::kFloat32);
  const int64_t generic16 = measure(
      [&](auto& h, auto& w) { return generic_ce(h, w, labels, kChunk); }, torch::kBFloat16);
  const int64_t cpu = measure(
      [&](auto& h, auto& w) {
        return fused_linear_cross_entropy(h, w, labels, -100, kChunk, FusedImpl::kCpuFp32);
      },
      torch::kFloat32);
  const int64_t composed = measure(
      [&](auto& h, auto& w) { return reference_ce(h, w, labels); }, torch::kFloat32);
  c10::SetCPUAllocator(previous, kPriority);
  ASSERT_EQ(c10::GetCPUAllocator(), previous);

  EXPECT_LT(generic32, kLogitsBytes / 4) << "generic fp32 peak " << generic32;
  EXPECT_LT(generic16, kLogitsBytes / 4) << "generic bf16 peak " << generic16;
  EXPECT_LT(cpu, kLogitsBytes / 4) << "CPU kernel peak " << cpu;
  EXPECT_GE(composed, kLogitsBytes) << "composition peak " << composed;
  std::printf("peak bytes: generic fp32 %lld, generic bf16 %lld, CPU kernel %lld, composition "
              "%lld (full logits %lld)\n",
              static_cast<long long>(generic32), static_cast<long long>(generic16),
              static_cast<long long>(cpu), static_cast<long long>(composed),
              static_cast<long long>(kLogitsBytes));
}

// ---- the other ops' generic path ------------------------------------------------------------

TEST(GenericFusedOps, RmsNormSwigluRopeMatchTheCpuKernels) {
  // Forced kGeneric on fp32 CPU tensors equals the ATen composition it is made of, and agrees
  // with the CPU kernels (fp32, rtol 1e-5 / atol 1e-6, as test_fused.cpp).
  torch::manual_seed(25);
  const torch::Tensor x = torch::randn({2, 9, 64});
  const torch::Tensor w = torch::randn({64});
  const torch::Tensor generic_norm = fused_rms_norm(x, w, 1e-5, FusedImpl::kGeneric);
  EXPECT_TRUE(torch::equal(generic_norm, at::rms_norm(x, {64}, w, 1e-5)));
  expect_close(generic_norm, fused_rms_norm(x, w, 1e-5, FusedImpl::kCpuFp32), 1e-5, 1e-6,
               "rms_norm");

  const torch::Tensor gate = torch::randn({7, 130}) * 3, up = torch::randn({7, 130});
  const torch::Tensor generic_swiglu = fused_swiglu(gate, up, FusedImpl::kGeneric);
  EXPECT_TRUE(torch::equal(generic_swiglu, at::silu(gate) * up));
  expect_close(generic_swiglu, fused_swiglu(gate, up, FusedImpl::kCpuFp32), 1e-5, 1e-6, "swiglu");

  const torch::Tensor cache = rope_cache(rope_inverse_frequencies(16, 10000.0, std::nullopt), 20);
  const torch::Tensor q = torch::randn({2, 11, 3, 16});
  expect_close(fused_rotary_embedding(q, cache, FusedImpl::kGeneric),
               fused_rotary_embedding(q, cache, FusedImpl::kCpuFp32), 1e-5, 1e-6, "rope");

  // bf16 inputs are the generic path's without asking, and keep their dtype.
  const torch::Tensor xb = x.to(torch::kBFloat16), wb = w.to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(fused_rms_norm(xb, wb, 1e-5), at::rms_norm(xb, {64}, wb, 1e-5)));
  EXPECT_EQ(fused_swiglu(gate.to(torch::kBFloat16), up.to(torch::kBFloat16)).scalar_type(),
            torch::kBFloat16);
  EXPECT_EQ(fused_rotary_embedding(q.to(torch::kBFloat16), cache).scalar_type(), torch::kBFloat16);
}

TEST(GenericFusedOps, AddRmsNormOffTheGpuIsTheAddThenTheNorm) {
  // Without the CUDA kernel (CPU tensors) the fused op is the unfused composition, bitwise, so a
  // block that calls it computes what it computed before; its gradients flow to all three inputs.
  torch::manual_seed(26);
  const torch::Tensor residual = torch::randn({2, 5, 64}).requires_grad_(true);
  const torch::Tensor delta = torch::randn({2, 5, 64}).requires_grad_(true);
  const torch::Tensor w = torch::randn({64}).requires_grad_(true);
  auto [sum, normed] = loom::nn::fused_add_rms_norm(residual, delta, w, 1e-5);
  const torch::Tensor ref_sum = residual + delta;
  EXPECT_TRUE(torch::equal(sum, ref_sum));
  EXPECT_TRUE(torch::equal(normed, fused_rms_norm(ref_sum, w, 1e-5)));
  const auto grads = torch::autograd::grad({(sum * 2).sum() + normed.sum()}, {residual, delta, w});
  const auto ref_grads =
      torch::autograd::grad({(ref_sum * 2).sum() + fused_rms_norm(ref_sum, w, 1e-5).sum()},
                            {residual, delta, w});
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(grads[i], ref_grads[i])) << i;
  // Forcing the CUDA kernel on CPU tensors is an error naming the fallback.
  loom::testing::expect_error<loom::Error>(
      [&] { loom::nn::fused_add_rms_norm(residual, delta, w, 1e-5, FusedImpl::kCuda); },
      {"fused_add_rms_norm", "FusedImpl::kGeneric"});
}

}  // namespace
