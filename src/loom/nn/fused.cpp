#include "loom/nn/fused.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cmath>
#include <limits>

#include "loom/core/error.h"
#include "loom/core/strings.h"

#ifdef LOOM_WITH_CUDA_KERNELS
#include "loom/nn/cuda/kernels.h"
#endif

namespace loom::nn {
namespace {

// Process-wide switch of the CUDA kernels (set_cuda_kernels); read at every call, written once at
// start-up before any forward.
std::atomic<unsigned> g_cuda_kernels{CudaKernelSet::all().bits};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the CPU kernels can take beyond the device/dtype choice: fp32 CPU tensors throughout.
bool cpu_fp32(const torch::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == torch::kFloat32;
}

// Resolves `forced` or the device/dtype choice to the implementation that runs. `cpu_ok` says
// whether the CPU kernel can take these particular inputs; when it cannot, an automatic choice
// degrades to kGeneric and a forced kCpuFp32 is an error.
FusedImpl resolve(std::optional<FusedImpl> forced, FusedImpl chosen, bool cpu_ok, const char* op) {
  const FusedImpl impl = forced.value_or(chosen);
  if (impl == FusedImpl::kGeneric || (impl == FusedImpl::kCpuFp32 && cpu_ok)) return impl;
  LOOM_REQUIRE(!forced.has_value() || impl != FusedImpl::kCpuFp32, op,
               ": the CPU fp32 kernel cannot take these inputs (it needs "
               "non-empty fp32 CPU tensors of matching shapes); use FusedImpl::kGeneric");
  return FusedImpl::kGeneric;
}

// The same for an op that has a CUDA kernel: `cuda_ok` says whether it can take these inputs (CUDA
// tensors of a dtype it handles, and the kernel not switched off).
FusedImpl resolve(std::optional<FusedImpl> forced, FusedImpl chosen, bool cpu_ok, bool cuda_ok,
                  const char* op) {
  const FusedImpl impl = forced.value_or(chosen);
  if (impl != FusedImpl::kCuda) return resolve(forced, chosen, cpu_ok, op);
  if (cuda_ok) return impl;
  LOOM_REQUIRE(!forced.has_value(), op, ": the CUDA kernel cannot take these inputs (it needs "
               "a CUDA build and fp32/bf16/fp16 CUDA tensors, and the kernel enabled in "
               "training.cuda_kernels); use FusedImpl::kGeneric");
  return FusedImpl::kGeneric;
}

// Whether `kernel` is built and enabled and every tensor is a CUDA tensor of a dtype it handles.
bool cuda_kernel_ok(CudaKernel kernel, std::initializer_list<const torch::Tensor*> tensors) {
  if (!cuda_kernels_built() || !enabled_cuda_kernels().has(kernel)) return false;
  for (const torch::Tensor* t : tensors) {
    const auto dt = t->scalar_type();
    if (!t->is_cuda() || t->numel() == 0 ||
        (dt != torch::kFloat32 && dt != torch::kBFloat16 && dt != torch::kHalf)) {
      return false;
    }
  }
  return true;
}

[[noreturn]] void fail_label(int64_t label, int64_t position, int64_t vocab) {
  loom::fail("cross-entropy label ", label, " at position ", position,
             " is outside the vocabulary [0, ", vocab, "); check the tokenizer and "
             "model.vocab_size");
}

// Rows per at::parallel_for task: ~32k elements, so a task is worth a thread wake-up.
int64_t row_grain(int64_t row_length) { return std::max<int64_t>(1, 32768 / row_length); }

// The loops below are compiled for AVX-512 and AVX2 next to the baseline, picked at load time
// (GCC/Clang function multi-versioning); exp-heavy loops are compute-bound on SSE2 otherwise.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LOOM_SIMD_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LOOM_SIMD_CLONES
#endif

// e^x as 2^n * e^r, n = round(x / ln 2), |r| <= ln(2) / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7, i.e. ~1 ulp). Branch- and call-free so `omp simd` loops vectorise it
// (a libm call would not). Inputs are clamped to [-87, 88]: below, the result is ~1e-38 instead of
// a denormal or 0; callers never pass larger values (softmax/sigmoid arguments are <= 0 or clamped).
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the mantissa
  const float t = x * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t k = std::bit_cast<int32_t>(t) - 0x4B400000;  // == n as an integer
  return p * std::bit_cast<float>((k + 127) << 23);
}

// ---- RMSNorm -------------------------------------------------------------------------------

struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps) {
    const torch::Tensor xc = x.contiguous();
    const torch::Tensor wc = weight.contiguous();
    const int64_t dim = xc.size(-1);
    const int64_t rows = xc.numel() / dim;
    torch::Tensor y = torch::empty_like(xc);
    torch::Tensor rstd = torch::empty({rows}, xc.options());
    const float* xp = xc.const_data_ptr<float>();
    const float* wp = wc.const_data_ptr<float>();
    float* yp = y.mutable_data_ptr<float>();
    float* rp = rstd.mutable_data_ptr<float>();
    const float feps = static_cast<float>(eps);
    const float inv_dim = 1.0f / static_cast<float>(dim);
    at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* xr = xp + r * dim;
        float* yr = yp + r * dim;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < dim; ++j) ss += xr[j] * xr[j];
        const float rs = 1.0f / std::sqrt(ss * inv_dim + feps);
        rp[r] = rs;
#pragma omp simd
        for (int64_t j = 0; j < dim; ++j) yr[j] = xr[j] * rs * wp[j];
      }
    });
    ctx->save_for_backward({xc, wc, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    const torch::Tensor& rstd = saved[2];
    const torch::Tensor dy = grad_outputs[0].contiguous();
    const int64_t dim = x.size(-1);
    const int64_t rows = x.numel() / dim;
    const bool need_dx = ctx->needs_input_grad(0);
    const bool need_dw = ctx->needs_input_grad(1);
    torch::Tensor dx = need_dx ? torch::empty_like(x) : torch::Tensor();
    // Weight gradient: one partial row per task, summed at the end. The split of rows into
    // tasks depends only on the thread count, so results are deterministic for a fixed count.
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
    torch::Tensor partial = need_dw ? torch::zeros({tasks, dim}, x.options()) : torch::Tensor();
    const float* xp = x.const_data_ptr<float>();
    const float* wp = w.const_data_ptr<float>();
    const float* rp = rstd.const_data_ptr<float>();
    const float* dyp = dy.const_data_ptr<float>();
    float* dxp = need_dx ? dx.mutable_data_ptr<float>() : nullptr;
    float* pp = need_dw ? partial.mutable_data_ptr<float>() : nullptr;
    const float inv_dim = 1.0f / static_cast<float>(dim);
    at::parallel_for(0, tasks, 1, [&](int64_t task_begin, int64_t task_end) {
      for (int64_t task = task_begin; task < task_end; ++task) {
        const int64_t r0 = rows * task / tasks;
        const int64_t r1 = rows * (task + 1) / tasks;
        float* dwr = need_dw ? pp + task * dim : nullptr;
        for (int64_t r = r0; r < r1; ++r) {
          const float* xr = xp + r * dim;
          const float* dyr = dyp + r * dim;
          const float rs = rp[r];
          if (need_dx) {
            // dx = rs * (dy*w - xhat * mean(dy*w*xhat)), xhat = x * rs.
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < dim; ++j) dot += dyr[j] * wp[j] * xr[j];
            const float c = dot * rs * rs * inv_dim;
            float* dxr = dxp + r * dim;
#pragma omp simd
            for (int64_t j = 0; j < dim; ++j) dxr[j] = rs * (dyr[j] * wp[j] - xr[j] * c);
          }
          if (need_dw) {
#pragma omp simd
            for (int64_t j = 0; j < dim; ++j) dwr[j] += dyr[j] * xr[j] * rs;
          }
        }
      }
    });
    return {dx, need_dw ? partial.sum(0) : torch::Tensor(), torch::Tensor()};
  }
};

// ---- RoPE ----------------------------------------------------------------------------------

// out[j] = x[j] * cos[j] + x[swap(j)] * sin[j], swap exchanging the two halves of the head dim
// (sin carries the sign). With `inverse`, applies the transpose: dx[j] = dy[j] * cos[j] +
// dy[swap(j)] * sin[swap(j)].
void rotate(const torch::Tensor& in, const torch::Tensor& cache, torch::Tensor& out, bool inverse) {
  const int64_t seq = in.size(1);
  const int64_t heads = in.size(2);
  const int64_t dim = in.size(3);
  const int64_t half = dim / 2;
  const int64_t rows = in.numel() / dim;
  const int64_t cache_stride = cache.size(1) * dim;
  const float* xp = in.const_data_ptr<float>();
  const float* cos_p = cache.const_data_ptr<float>();
  const float* sin_p = cos_p + cache_stride;
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = (r / heads) % seq;
      const float* c = cos_p + t * dim;
      const float* s = sin_p + t * dim;
      const float* x = xp + r * dim;
      float* o = op + r * dim;
      if (!inverse) {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) o[j] = x[j] * c[j] + x[j + half] * s[j];
#pragma omp simd
        for (int64_t j = half; j < dim; ++j) o[j] = x[j] * c[j] + x[j - half] * s[j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) o[j] = x[j] * c[j] + x[j + half] * s[j + half];
#pragma omp simd
        for (int64_t j = half; j < dim; ++j) o[j] = x[j] * c[j] + x[j - half] * s[j - half];
      }
    }
  });
}

struct RotaryFunction : public torch::autograd::Function<RotaryFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cache) {
    const torch::Tensor xc = x.contiguous();
    torch::Tensor out = torch::empty_like(xc);
    rotate(xc, cache, out, /*inverse=*/false);
    ctx->saved_data["cache"] = cache;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const torch::Tensor dy = grad_outputs[0].contiguous();
    torch::Tensor dx = torch::empty_like(dy);
    rotate(dy, ctx->saved_data["cache"].toTensor(), dx, /*inverse=*/true);
    return {dx, torch::Tensor()};
  }
};

torch::Tensor rotary_composite(const torch::Tensor& x, const torch::Tensor& cache) {
  const int64_t seq_len = x.size(1);
  const int64_t half = x.size(3) / 2;
  // [T, 1, D] broadcasts over batch and heads.
  torch::Tensor cos = cache.select(0, 0).narrow(0, 0, seq_len).unsqueeze(1).to(x.scalar_type());
  torch::Tensor sin = cache.select(0, 1).narrow(0, 0, seq_len).unsqueeze(1).to(x.scalar_type());
  torch::Tensor swapped = torch::cat({x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return (x * cos).addcmul_(swapped, sin);
}

// ---- SwiGLU --------------------------------------------------------------------------------

LOOM_SIMD_CLONES void swiglu_forward_range(const float* g, const float* u, float* y, int64_t begin,
                                           int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) y[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
}

// d silu(g) / dg = s * (1 + g * (1 - s)), s = sigmoid(g).
LOOM_SIMD_CLONES void swiglu_backward_range(const float* g, const float* u, const float* dy,
                                            float* dg, float* du, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float s = 1.0f / (1.0f + exp_poly(-g[i]));
    dg[i] = dy[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    du[i] = dy[i] * g[i] * s;
  }
}

struct SwiGLUFunction : public torch::autograd::Function<SwiGLUFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up) {
    const torch::Tensor g = gate.contiguous();
    const torch::Tensor u = up.contiguous();
    torch::Tensor y = torch::empty_like(g);
    const float* gp = g.const_data_ptr<float>();
    const float* up_ = u.const_data_ptr<float>();
    float* yp = y.mutable_data_ptr<float>();
    at::parallel_for(0, g.numel(), 32768, [&](int64_t begin, int64_t end) {
      swiglu_forward_range(gp, up_, yp, begin, end);
    });
    // sigmoid(gate) is recomputed in backward rather than saved: an exp is cheaper than a pass.
    ctx->save_for_backward({g, u});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor dy = grad_outputs[0].contiguous();
    const bool need_gate = ctx->needs_input_grad(0);
    const bool need_up = ctx->needs_input_grad(1);
    torch::Tensor d_gate = torch::empty_like(saved[0]);
    torch::Tensor d_up = torch::empty_like(saved[1]);
    const float* gp = saved[0].const_data_ptr<float>();
    const float* up_ = saved[1].const_data_ptr<float>();
    const float* dyp = dy.const_data_ptr<float>();
    float* dgp = d_gate.mutable_data_ptr<float>();
    float* dup = d_up.mutable_data_ptr<float>();
    at::parallel_for(0, dy.numel(), 32768, [&](int64_t begin, int64_t end) {
      swiglu_backward_range(gp, up_, dyp, dgp, dup, begin, end);
    });
    return {need_gate ? d_gate : torch::Tensor(), need_up ? d_up : torch::Tensor()};
  }
};

// ---- Output head + cross-entropy -----------------------------------------------------------

// One row of logits, in L2: max, sum of exp -> logsumexp; returns the row's loss. With
// `need_grad`, turns the row in place into scale * (softmax - onehot(label)) = d loss / d logits.
LOOM_SIMD_CLONES float cross_entropy_row(float* row, int64_t vocab, int64_t label, float scale,
                                         bool need_grad) {
  float max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max)
  for (int64_t j = 0; j < vocab; ++j) max = std::max(max, row[j]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < vocab; ++j) sum += exp_poly(row[j] - max);
  const float lse = max + std::log(sum);
  const float loss = lse - row[label];
  if (need_grad) {
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) row[j] = exp_poly(row[j] - lse) * scale;
    row[label] -= scale;
  }
  return loss;
}

struct LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& labels,
                               int64_t ignore_index, int64_t chunk_tokens, bool need_hidden_grad,
                               bool need_weight_grad) {
    const torch::Tensor h = hidden.contiguous();
    const torch::Tensor w = weight.contiguous();
    const torch::Tensor lab = labels.contiguous();
    const int64_t tokens = h.size(0);
    const int64_t vocab = w.size(0);
    const int64_t* lp = lab.const_data_ptr<int64_t>();
    int64_t n_valid = 0;
    for (int64_t i = 0; i < tokens; ++i) {
      if (lp[i] == ignore_index) continue;
      if (lp[i] < 0 || lp[i] >= vocab) fail_label(lp[i], i, vocab);
      ++n_valid;
    }
    // mean over valid tokens (0 when none: see fused.h); each softmax row is pre-scaled by it.
    const double scale = n_valid > 0 ? 1.0 / static_cast<double>(n_valid) : 0.0;
    const bool need_grad = need_hidden_grad || need_weight_grad;
    torch::Tensor grad_hidden = need_hidden_grad ? torch::empty_like(h) : torch::Tensor();
    torch::Tensor grad_weight;
    const int64_t chunk = std::min(chunk_tokens, tokens);
    torch::Tensor buffer = torch::empty({chunk, vocab}, h.options());
    torch::Tensor losses = torch::empty({chunk}, h.options());
    double loss_sum = 0.0;
    for (int64_t c0 = 0; c0 < tokens; c0 += chunk) {
      const int64_t c = std::min(chunk, tokens - c0);
      const torch::Tensor hc = h.narrow(0, c0, c);
      torch::Tensor logits = buffer.narrow(0, 0, c);
      at::mm_out(logits, hc, w.t());
      float* logp = logits.mutable_data_ptr<float>();
      float* row_loss = losses.mutable_data_ptr<float>();
      const float fscale = static_cast<float>(scale);
      // Per row, in L2: max, sum of exp -> logsumexp and the loss; then, in place,
      // logits -> scale * (softmax - onehot) = d loss / d logits.
      at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          float* row = logp + r * vocab;
          const int64_t label = lp[c0 + r];
          if (label == ignore_index) {
            row_loss[r] = 0.0f;
            if (need_grad) std::fill(row, row + vocab, 0.0f);
            continue;
          }
          row_loss[r] = cross_entropy_row(row, vocab, label, fscale, need_grad);
        }
      });
      for (int64_t r = 0; r < c; ++r) loss_sum += row_loss[r];
      if (!need_grad) continue;
      if (need_hidden_grad) {
        torch::Tensor out = grad_hidden.narrow(0, c0, c);
        at::mm_out(out, logits, w);
      }
      if (need_weight_grad) {
        if (!grad_weight.defined()) {
          grad_weight = at::mm(logits.t(), hc);
        } else {
          grad_weight.addmm_(logits.t(), hc);
        }
      }
    }
    ctx->saved_data["grad_hidden"] = grad_hidden;
    ctx->saved_data["grad_weight"] = grad_weight;
    return torch::full({}, loss_sum * scale, h.options());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // Take the gradients out of the context so AccumulateGrad can adopt them without a copy.
    torch::Tensor grad_hidden = ctx->saved_data["grad_hidden"].toTensor();
    torch::Tensor grad_weight = ctx->saved_data["grad_weight"].toTensor();
    ctx->saved_data.erase("grad_hidden");
    ctx->saved_data.erase("grad_weight");
    const torch::Tensor& g = grad_outputs[0];
    if (g.item<float>() != 1.0f) {
      if (grad_hidden.defined()) grad_hidden.mul_(g);
      if (grad_weight.defined()) grad_weight.mul_(g);
    }
    return {grad_hidden, grad_weight, torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

// Device-generic twin of LinearCrossEntropyFunction, in ATen ops only (CUDA, bf16/fp16/fp64,
// autocast, or forced on the CPU). Same chunking and the same Liger-kernel choice: the gradients
// of hidden and weight are computed chunk by chunk in the forward, while the chunk's logits exist,
// and the backward only scales them. Recomputing in backward instead would hold nothing extra
// between forward and backward (the gradients are as big as the inputs, which are alive anyway)
// but would run the [chunk, dim] x [dim, vocab] logits GEMM twice: +50% of the head's FLOPs, the
// largest GEMM of a small model. The cost of this choice: a forward under grad mode does the
// gradient work even if no backward follows, so the entry point asks for gradients only when
// GradMode is on and the input requires them.
//
// Per chunk, with c = chunk tokens, V = vocab, compute dtype ct (see linear_compute_dtype):
//   logits [c, V] in ct -> fp32 (softmax math in fp32 whatever ct; fp64 stays fp64)
//   lse = logsumexp(logits); loss += sum over valid rows of lse - logits[label]
//   logits <- exp(logits - lse) - onehot(label), times 1/num_valid on valid rows, 0 on ignored
//   grad_hidden[chunk] = dlogits(ct) @ W;  grad_weight += dlogits(ct)^T @ h_chunk, in fp32
// so the peak extra memory is a few [c, V] buffers, never [N, V].
struct GenericLinearCrossEntropyFunction
    : public torch::autograd::Function<GenericLinearCrossEntropyFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& labels,
                               int64_t ignore_index, int64_t chunk_tokens,
                               c10::ScalarType compute_dtype, bool need_hidden_grad,
                               bool need_weight_grad) {
    // The ops below are written for the dtypes they name; keep autocast from re-casting them (the
    // entry point already resolved autocast's choice into compute_dtype).
    const c10::DeviceType device_type = hidden.device().type();
    std::optional<c10::impl::ExcludeDispatchKeyGuard> no_autocast;
    if (at::autocast::is_autocast_available(device_type)) {
      no_autocast.emplace(at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
    }
    const torch::Tensor h = hidden.contiguous();
    const torch::Tensor w = weight.to(compute_dtype).contiguous();  // no copy when it already is
    const torch::Tensor lab = labels.contiguous();
    const int64_t tokens = h.size(0);
    const int64_t vocab = w.size(0);
    const c10::ScalarType math_dtype = c10::promoteTypes(compute_dtype, torch::kFloat32);

    // Nothing below reads a device value on the host: the count of valid tokens (every gradient
    // row is scaled by its inverse, the loss divided by it) stays a device tensor. Out-of-range
    // labels would make gather read out of bounds (a device-side assert on CUDA, which poisons the
    // context): on the CPU, where the check costs nothing, they are an error naming the position;
    // elsewhere they gather column 0 and make the loss nan (the trainer has checked the token ids
    // on the host already).
    const torch::Tensor valid = lab.ne(ignore_index);
    const torch::Tensor bad = valid.logical_and(lab.lt(0).logical_or(lab.ge(vocab)));
    if (lab.device().is_cpu() && bad.any().item<bool>()) {
      const int64_t pos = at::nonzero(bad).select(1, 0)[0].item<int64_t>();
      fail_label(lab[pos].item<int64_t>(), pos, vocab);
    }
    const torch::Tensor usable = valid.logical_and(bad.logical_not());
    // mean over valid tokens: with none valid the loss is 0 and the gradients all zero
    // (row_scale 0; see fused.h).
    const torch::Tensor n_valid = valid.sum().to(math_dtype);
    const torch::Tensor scale = n_valid.reciprocal();
    const torch::Tensor row_scale = at::where(n_valid.gt(0), scale, at::zeros_like(scale));

    const bool need_grad = need_hidden_grad || need_weight_grad;
    torch::Tensor grad_hidden = need_hidden_grad ? torch::empty_like(h) : torch::Tensor();
    torch::Tensor grad_weight;  // fp32 (math dtype) accumulator
    torch::Tensor loss_sum = torch::zeros({}, h.options().dtype(math_dtype));
    const int64_t chunk = std::max<int64_t>(1, std::min(chunk_tokens, tokens));
    for (int64_t c0 = 0; c0 < tokens; c0 += chunk) {
      const int64_t c = std::min(chunk, tokens - c0);
      const torch::Tensor hc = h.narrow(0, c0, c).to(compute_dtype);
      const torch::Tensor lab_c = lab.narrow(0, c0, c);
      const torch::Tensor valid_c = usable.narrow(0, c0, c);
      // Ignored rows gather column 0 and are masked out below.
      const torch::Tensor target = lab_c.masked_fill(valid_c.logical_not(), 0).unsqueeze(1);
      // In the compute dtype (the GEMM), then the math dtype; the compute-dtype logits die here.
      torch::Tensor logits = at::mm(hc, w.t()).to(math_dtype);
      const torch::Tensor lse = at::logsumexp(logits, {1}, /*keepdim=*/true);
      const torch::Tensor row_loss = (lse - logits.gather(1, target)).squeeze(1);
      loss_sum.add_(row_loss.masked_fill(valid_c.logical_not(), 0).sum());
      if (!need_grad) continue;
      // logits -> d loss / d logits in place: softmax - onehot, times the row's scale.
      logits.sub_(lse).exp_();
      logits.scatter_add_(1, target, valid_c.to(math_dtype).neg().unsqueeze(1));
      logits.mul_(valid_c.to(math_dtype).mul_(row_scale).unsqueeze(1));
      const torch::Tensor dlogits = logits.to(compute_dtype);
      logits = torch::Tensor();  // the math-dtype copy is not needed once dlogits exists
      if (need_hidden_grad) {
        torch::Tensor out = grad_hidden.narrow(0, c0, c);
        if (out.scalar_type() == compute_dtype) {
          at::mm_out(out, dlogits, w);
        } else {
          out.copy_(at::mm(dlogits, w));
        }
      }
      if (need_weight_grad) {
        if (!grad_weight.defined()) {
          grad_weight = at::mm(dlogits.t(), hc).to(math_dtype);
        } else if (compute_dtype == math_dtype) {
          grad_weight.addmm_(dlogits.t(), hc);
        } else {
          // addmm_ does not mix dtypes: the chunk's product in the compute dtype (the GEMM still
          // accumulates in fp32 inside), the sum over chunks in fp32.
          grad_weight.add_(at::mm(dlogits.t(), hc));
        }
      }
    }
    if (need_weight_grad) {
      grad_weight = grad_weight.defined() ? grad_weight.to(weight.scalar_type())
                                          : torch::zeros_like(weight);
    }
    ctx->saved_data["grad_hidden"] = grad_hidden;
    ctx->saved_data["grad_weight"] = grad_weight;
    torch::Tensor loss = loss_sum.mul(row_scale).to(torch::kFloat32);  // 0 when no label is valid
    if (!lab.device().is_cpu()) {
      loss = at::where(bad.any(), at::full_like(loss, std::numeric_limits<float>::quiet_NaN()), loss);
    }
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    torch::Tensor grad_hidden = ctx->saved_data["grad_hidden"].toTensor();
    torch::Tensor grad_weight = ctx->saved_data["grad_weight"].toTensor();
    ctx->saved_data.erase("grad_hidden");
    ctx->saved_data.erase("grad_weight");
    // Always a device-side multiply: reading the incoming gradient on the host (as the CPU path
    // does to skip a multiply by 1) would be a sync on an accelerator.
    const torch::Tensor& g = grad_outputs[0];
    if (grad_hidden.defined()) grad_hidden.mul_(g);
    if (grad_weight.defined()) grad_weight.mul_(g);
    return {grad_hidden, grad_weight, torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

#ifdef LOOM_WITH_CUDA_KERNELS
// Autograd wrappers of the CUDA kernels (cuda/kernels.h). Each saves what its backward kernel reads.
struct CudaSwiGLUFunction : public torch::autograd::Function<CudaSwiGLUFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return cuda::swiglu_forward(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_gate, grad_up] = cuda::swiglu_backward(grad_outputs[0], saved[0], saved[1]);
    return {grad_gate, grad_up};
  }
};

struct CudaRMSNormFunction : public torch::autograd::Function<CudaRMSNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps, c10::ScalarType out_dtype) {
    const torch::Tensor xc = x.contiguous();
    auto [y, rstd] = cuda::rms_norm_forward(xc, weight, eps, out_dtype);
    ctx->save_for_backward({xc, weight, rstd});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight] =
        cuda::rms_norm_backward(grad_outputs[0].contiguous(), saved[0], saved[1], saved[2]);
    return {grad_x, grad_weight, torch::Tensor(), torch::Tensor()};
  }
};

// Outputs (sum, y); saves the sum (an output), the weight and rstd.
struct CudaAddRMSNormFunction : public torch::autograd::Function<CudaAddRMSNormFunction> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& residual,
                               const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                               c10::ScalarType out_dtype) {
    auto [sum, y, rstd] = cuda::add_rms_norm_forward(residual, delta, weight, eps, out_dtype);
    ctx->save_for_backward({sum, weight, rstd});
    ctx->saved_data["delta_dtype"] = static_cast<int64_t>(delta.scalar_type());
    return {sum, y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const auto delta_dtype =
        static_cast<c10::ScalarType>(ctx->saved_data["delta_dtype"].toInt());
    // An unused y has no gradient: the norm's part is then zero.
    const torch::Tensor grad_y =
        grad_outputs[1].defined() ? grad_outputs[1] : torch::zeros_like(saved[0]);
    auto [grad_residual, grad_delta, grad_weight] = cuda::add_rms_norm_backward(
        grad_y, grad_outputs[0], saved[0], saved[1], saved[2], delta_dtype);
    return {grad_residual, grad_delta, grad_weight, torch::Tensor(), torch::Tensor()};
  }
};

struct CudaRotaryFunction : public torch::autograd::Function<CudaRotaryFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cache) {
    ctx->saved_data["cache"] = cache;
    return cuda::rope_forward(x, cache, /*inverse=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const torch::Tensor cache = ctx->saved_data["cache"].toTensor();
    return {cuda::rope_forward(grad_outputs[0], cache, /*inverse=*/true), torch::Tensor()};
  }
};

// Rows per chunk of the CUDA loss: at least `requested`, as many as fit in min(1 GiB, 1/8 of what
// the allocator can still hand out) of compute-dtype logits, at most 4096 (past that the GEMMs are
// as efficient and the memory is better spent elsewhere), in multiples of 256 rows.
int64_t cuda_chunk_rows(const torch::Tensor& on, int64_t tokens, int64_t vocab,
                        c10::ScalarType dtype, int64_t requested) {
  const int64_t budget =
      std::min<int64_t>(int64_t{1} << 30, cuda::allocatable_bytes(on.get_device()) / 8);
  const int64_t row_bytes = vocab * static_cast<int64_t>(c10::elementSize(dtype));
  int64_t rows = std::min<int64_t>(4096, budget / std::max<int64_t>(1, row_bytes)) / 256 * 256;
  rows = std::max(rows, requested);
  return std::max<int64_t>(1, std::min(rows, tokens));
}

// grad_weight (fp32) += a^T-shaped product in the compute dtype, written by the GEMM in fp32 (no
// compute-dtype product to add). Falls back to a product plus an add if this libtorch's
// addmm(out_dtype) refuses these dtypes.
void accumulate_fp32(torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& b) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  static std::atomic<bool> out_dtype_ok{true};
  if (out_dtype_ok.load(std::memory_order_relaxed)) {
    try {
      at::addmm_out(acc, acc, a, b, at::kFloat);
      return;
    } catch (const c10::Error&) {
      out_dtype_ok.store(false, std::memory_order_relaxed);
    }
  }
#endif  // addmm(out_dtype) came with torch 2.8
  acc.add_(at::mm(a, b));
}

// The CUDA twin of GenericLinearCrossEntropyFunction: the same chunked scheme (gradients of hidden
// and weight computed in the forward, the backward only scales them), with the per-chunk softmax,
// loss and dlogits done by one kernel in place on the compute-dtype logits, chunks sized from the
// free memory, and no host synchronisation anywhere.
struct CudaLinearCrossEntropyFunction
    : public torch::autograd::Function<CudaLinearCrossEntropyFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& labels,
                               int64_t ignore_index, int64_t chunk_tokens,
                               c10::ScalarType compute_dtype, bool need_hidden_grad,
                               bool need_weight_grad) {
    std::optional<c10::impl::ExcludeDispatchKeyGuard> no_autocast;
    if (at::autocast::is_autocast_available(c10::DeviceType::CUDA)) {
      no_autocast.emplace(at::autocast::get_autocast_dispatch_key_from_device_type(c10::DeviceType::CUDA));
    }
    const torch::Tensor h = hidden.to(compute_dtype).contiguous();
    const torch::Tensor w = weight.to(compute_dtype).contiguous();
    const torch::Tensor lab = labels.contiguous();
    const int64_t tokens = h.size(0);
    const int64_t vocab = w.size(0);
    const bool need_grad = need_hidden_grad || need_weight_grad;

    const torch::Tensor n_valid = lab.ne(ignore_index).sum().to(torch::kFloat32);
    const torch::Tensor scale = n_valid.reciprocal();  // inf when no token is valid: row_scale is 0 then
    const torch::Tensor row_scale = at::where(n_valid.gt(0), scale, at::zeros_like(scale));
    torch::Tensor bad = torch::zeros({}, lab.options().dtype(torch::kInt32));
    torch::Tensor row_loss = torch::empty({tokens}, h.options().dtype(torch::kFloat32));
    torch::Tensor grad_hidden =
        need_hidden_grad ? torch::empty(hidden.sizes(), hidden.options()) : torch::Tensor();
    torch::Tensor grad_weight =
        need_weight_grad ? torch::zeros(weight.sizes(), w.options().dtype(torch::kFloat32))
                         : torch::Tensor();

    const int64_t chunk = cuda_chunk_rows(h, tokens, vocab, compute_dtype, chunk_tokens);
    // One logits buffer for every chunk: the stream orders each chunk's GEMMs after the previous
    // chunk's readers.
    torch::Tensor buffer = torch::empty({chunk, vocab}, w.options());
    for (int64_t c0 = 0; c0 < tokens; c0 += chunk) {
      const int64_t c = std::min(chunk, tokens - c0);
      const torch::Tensor hc = h.narrow(0, c0, c);
      torch::Tensor logits = buffer.narrow(0, 0, c);
      at::mm_out(logits, hc, w.t());
      torch::Tensor loss_c = row_loss.narrow(0, c0, c);
      cuda::cross_entropy_chunk_(logits, lab.narrow(0, c0, c), ignore_index, row_scale, loss_c,
                                 bad, need_grad);
      if (need_hidden_grad) {
        torch::Tensor out = grad_hidden.narrow(0, c0, c);
        if (out.scalar_type() == compute_dtype) {
          at::mm_out(out, logits, w);
        } else {
          out.copy_(at::mm(logits, w));
        }
      }
      if (need_weight_grad) {
        if (compute_dtype == torch::kFloat32) {
          grad_weight.addmm_(logits.t(), hc);
        } else {
          accumulate_fp32(grad_weight, logits.t(), hc);
        }
      }
    }
    if (need_weight_grad && grad_weight.scalar_type() != weight.scalar_type()) {
      grad_weight = grad_weight.to(weight.scalar_type());
    }
    ctx->saved_data["grad_hidden"] = grad_hidden;
    ctx->saved_data["grad_weight"] = grad_weight;
    const torch::Tensor loss = row_loss.sum().mul(row_scale);  // 0 when no label is valid
    return at::where(bad.gt(0), at::full_like(loss, std::numeric_limits<float>::quiet_NaN()), loss);
  }

  // The same saved gradients and arguments as the generic function: the same backward.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return GenericLinearCrossEntropyFunction::backward(ctx, std::move(grad_outputs));
  }
};
#endif  // LOOM_WITH_CUDA_KERNELS

}  // namespace

FusedImpl fused_impl_for(c10::Device device, c10::ScalarType compute_dtype) {
  if (device.is_cpu() && compute_dtype == torch::kFloat32) return FusedImpl::kCpuFp32;
  if (device.is_cuda() && cuda_kernels_built() &&
      (compute_dtype == torch::kFloat32 || compute_dtype == torch::kBFloat16 ||
       compute_dtype == torch::kHalf)) {
    return FusedImpl::kCuda;
  }
  return FusedImpl::kGeneric;
}

bool cuda_kernels_built() {
#ifdef LOOM_WITH_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

CudaKernelSet parse_cuda_kernels(const std::string& spec) {
  static const std::pair<const char*, CudaKernel> kNames[] = {
      {"swiglu", CudaKernel::kSwiGLU},
      {"rms_norm", CudaKernel::kRmsNorm},
      {"rope", CudaKernel::kRope},
      {"cross_entropy", CudaKernel::kCrossEntropy},
      {"adamw", CudaKernel::kAdamW},
      {"add_rms_norm", CudaKernel::kAddRmsNorm}};
  if (spec == "all") return CudaKernelSet::all();
  CudaKernelSet set;
  if (spec == "none") return set;
  size_t begin = 0;
  while (begin <= spec.size()) {
    const size_t end = std::min(spec.find(',', begin), spec.size());
    const std::string name = spec.substr(begin, end - begin);
    bool known = false;
    for (const auto& [n, k] : kNames) {
      if (name == n) {
        set.bits |= static_cast<unsigned>(k);
        known = true;
      }
    }
    LOOM_REQUIRE_USAGE(known, "training.cuda_kernels: unknown kernel '", name, "' in '", spec,
                       "'; use all, none, or a comma-separated list of swiglu, rms_norm, rope, "
                       "cross_entropy, adamw, add_rms_norm");
    begin = end + 1;
  }
  return set;
}

void set_cuda_kernels(CudaKernelSet kernels) { g_cuda_kernels.store(kernels.bits); }

CudaKernelSet enabled_cuda_kernels() { return {g_cuda_kernels.load()}; }

c10::ScalarType linear_compute_dtype(const torch::Tensor& hidden, const torch::Tensor& weight) {
  const c10::DeviceType device_type = hidden.device().type();
  if (at::autocast::is_autocast_available(device_type) &&
      at::autocast::is_autocast_enabled(device_type) &&
      at::autocast::is_eligible(hidden, device_type) &&
      at::autocast::is_eligible(weight, device_type)) {
    return at::autocast::get_autocast_dtype(device_type);
  }
  return c10::promoteTypes(hidden.scalar_type(), weight.scalar_type());
}

torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                             std::optional<FusedImpl> impl) {
  const bool cpu_ok = cpu_fp32(x) && cpu_fp32(weight) && x.dim() > 0 && weight.dim() == 1 &&
                      weight.size(0) == x.size(-1) && x.numel() > 0;
  const bool cuda_ok = cuda_kernel_ok(CudaKernel::kRmsNorm, {&x, &weight}) && x.dim() > 0 &&
                       weight.dim() == 1 && weight.size(0) == x.size(-1);
  const FusedImpl chosen =
      resolve(impl, fused_impl_for(x.device(), x.scalar_type()), cpu_ok, cuda_ok, "fused_rms_norm");
  if (chosen == FusedImpl::kGeneric) return at::rms_norm(x, {weight.size(-1)}, weight, eps);
#ifdef LOOM_WITH_CUDA_KERNELS
  if (chosen == FusedImpl::kCuda) {
    const bool autocast = at::autocast::is_autocast_enabled(c10::DeviceType::CUDA);
    const c10::ScalarType out_dtype =
        autocast ? at::autocast::get_autocast_dtype(c10::DeviceType::CUDA) : x.scalar_type();
    return CudaRMSNormFunction::apply(x, weight, eps, out_dtype);
  }
#endif
  return RMSNormFunction::apply(x, weight, eps);
}

std::pair<torch::Tensor, torch::Tensor> fused_add_rms_norm(const torch::Tensor& residual,
                                                           const torch::Tensor& delta,
                                                           const torch::Tensor& weight, double eps,
                                                           std::optional<FusedImpl> impl) {
  const bool cuda_ok =
      cuda_kernel_ok(CudaKernel::kAddRmsNorm, {&residual, &delta, &weight}) &&
      residual.dim() > 0 && residual.sizes() == delta.sizes() && weight.dim() == 1 &&
      weight.size(0) == residual.size(-1) &&
      c10::promoteTypes(residual.scalar_type(), delta.scalar_type()) == residual.scalar_type();
  const FusedImpl chosen = impl.value_or(fused_impl_for(residual.device(), residual.scalar_type()));
  if (chosen == FusedImpl::kCuda && cuda_ok) {
#ifdef LOOM_WITH_CUDA_KERNELS
    const bool autocast = at::autocast::is_autocast_enabled(c10::DeviceType::CUDA);
    const c10::ScalarType out_dtype =
        autocast ? at::autocast::get_autocast_dtype(c10::DeviceType::CUDA) : residual.scalar_type();
    variable_list out = CudaAddRMSNormFunction::apply(residual, delta, weight, eps, out_dtype);
    return {out[0], out[1]};
#endif
  }
  LOOM_REQUIRE(!impl.has_value() || *impl != FusedImpl::kCuda || cuda_ok,
               "fused_add_rms_norm: the CUDA kernel cannot take these inputs (it needs a CUDA "
               "build, fp32/bf16/fp16 CUDA tensors of one shape with the residual the wider "
               "dtype, and add_rms_norm enabled in training.cuda_kernels); use FusedImpl::kGeneric");
  torch::Tensor sum = residual + delta;
  torch::Tensor normed = fused_rms_norm(sum, weight, eps,
                                        impl == FusedImpl::kCuda ? std::nullopt : impl);
  return {sum, normed};
}

torch::Tensor fused_rotary_embedding(const torch::Tensor& x, const torch::Tensor& cache,
                                     std::optional<FusedImpl> impl) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0,
              "fused_rotary_embedding expects [B, T, H, D] with even D, got ", x.sizes());
  TORCH_CHECK(cache.dim() == 3 && cache.size(0) == 2 && cache.size(2) == x.size(3) &&
                  cache.size(1) >= x.size(1),
              "RoPE cache of shape ", cache.sizes(), " does not fit x of shape ", x.sizes());
  const bool cpu_ok = cpu_fp32(x) && cpu_fp32(cache) && cache.is_contiguous() && x.numel() > 0;
  const bool cuda_ok = cuda_kernel_ok(CudaKernel::kRope, {&x}) && cache.is_cuda() &&
                       cache.scalar_type() == torch::kFloat32 && cache.is_contiguous();
  const FusedImpl chosen = resolve(impl, fused_impl_for(x.device(), x.scalar_type()), cpu_ok,
                                   cuda_ok, "fused_rotary_embedding");
  if (chosen == FusedImpl::kGeneric) return rotary_composite(x, cache);
#ifdef LOOM_WITH_CUDA_KERNELS
  if (chosen == FusedImpl::kCuda) return CudaRotaryFunction::apply(x, cache);
#endif
  return RotaryFunction::apply(x, cache);
}

torch::Tensor fused_swiglu(const torch::Tensor& gate, const torch::Tensor& up,
                           std::optional<FusedImpl> impl) {
  const bool cpu_ok = cpu_fp32(gate) && cpu_fp32(up) && gate.sizes() == up.sizes();
  const bool cuda_ok = cuda_kernel_ok(CudaKernel::kSwiGLU, {&gate, &up}) &&
                       gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type();
  const FusedImpl chosen = resolve(impl, fused_impl_for(gate.device(), gate.scalar_type()), cpu_ok,
                                   cuda_ok, "fused_swiglu");
  if (chosen == FusedImpl::kGeneric) return at::silu(gate) * up;
#ifdef LOOM_WITH_CUDA_KERNELS
  if (chosen == FusedImpl::kCuda) return CudaSwiGLUFunction::apply(gate, up);
#endif
  return SwiGLUFunction::apply(gate, up);
}

torch::Tensor fused_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                         const torch::Tensor& labels, int64_t ignore_index,
                                         int64_t chunk_tokens, std::optional<FusedImpl> impl) {
  LOOM_REQUIRE(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
               "fused_linear_cross_entropy needs hidden [N, dim] and weight [vocab, dim], got ",
               hidden.sizes(), " and ", weight.sizes());
  LOOM_REQUIRE(labels.dim() == 1 && labels.size(0) == hidden.size(0) &&
                   labels.scalar_type() == torch::kInt64,
               "fused_linear_cross_entropy needs int64 labels [", hidden.size(0), "], got ",
               labels.scalar_type(), " ", labels.sizes());
  LOOM_REQUIRE(chunk_tokens > 0, "fused_linear_cross_entropy chunk_tokens must be > 0, got ",
               chunk_tokens);
  LOOM_REQUIRE(labels.device() == hidden.device() && weight.device() == hidden.device(),
               "fused_linear_cross_entropy needs hidden, weight and labels on one device, got ",
               hidden.device(), ", ", weight.device(), " and ", labels.device());
  const c10::ScalarType compute_dtype = linear_compute_dtype(hidden, weight);
  // The CPU kernel computes in its inputs' fp32: both must be fp32 and autocast off (under CPU
  // autocast compute_dtype is bf16 and the choice is kGeneric).
  const bool cpu_ok = cpu_fp32(hidden) && cpu_fp32(weight) && compute_dtype == torch::kFloat32 &&
                      hidden.size(0) > 0;
  const bool cuda_ok = cuda_kernel_ok(CudaKernel::kCrossEntropy, {&hidden, &weight}) &&
                       labels.is_cuda() && hidden.size(0) > 0 &&
                       (compute_dtype == torch::kFloat32 || compute_dtype == torch::kBFloat16 ||
                        compute_dtype == torch::kHalf);
  const FusedImpl chosen = resolve(impl, fused_impl_for(hidden.device(), compute_dtype), cpu_ok,
                                   cuda_ok, "fused_linear_cross_entropy");
  const bool grad = torch::GradMode::is_enabled();
  const bool need_hidden_grad = grad && hidden.requires_grad();
  const bool need_weight_grad = grad && weight.requires_grad();
#ifdef LOOM_WITH_CUDA_KERNELS
  if (chosen == FusedImpl::kCuda) {
    return CudaLinearCrossEntropyFunction::apply(hidden, weight, labels, ignore_index,
                                                 chunk_tokens, compute_dtype, need_hidden_grad,
                                                 need_weight_grad);
  }
#endif
  if (chosen == FusedImpl::kGeneric) {
    return GenericLinearCrossEntropyFunction::apply(hidden, weight, labels, ignore_index,
                                                    chunk_tokens, compute_dtype, need_hidden_grad,
                                                    need_weight_grad);
  }
  return LinearCrossEntropyFunction::apply(hidden, weight, labels, ignore_index, chunk_tokens,
                                           need_hidden_grad, need_weight_grad);
}

}  // namespace loom::nn
