#include "loom/nn/attention.h"

#include <cmath>
#include <limits>
#include <utility>

#include "loom/core/error.h"
#include "loom/nn/rope.h"

namespace loom::nn {

Attention::Attention(int64_t dim, int64_t n_heads, int64_t n_kv_heads,
                     const torch::TensorOptions& options, const AttentionOptions& variant)
    : SelfAttention("Attention"), n_heads_(n_heads), n_kv_heads_(n_kv_heads) {
  LOOM_REQUIRE(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
               "n_heads (", n_heads, ") must be a positive multiple of n_kv_heads (", n_kv_heads,
               ")");
  LOOM_REQUIRE(variant.head_dim > 0 || dim % n_heads == 0, "dim (", dim,
               ") must be divisible by n_heads (", n_heads, ") unless head_dim is given");
  head_dim_ = variant.head_dim > 0 ? variant.head_dim : dim / n_heads;
  const bool bias = variant.bias;
  wq_ = register_module("wq", std::make_shared<Linear>(dim, n_heads * head_dim_, options, bias));
  wk_ = register_module("wk", std::make_shared<Linear>(dim, n_kv_heads * head_dim_, options, bias));
  wv_ = register_module("wv", std::make_shared<Linear>(dim, n_kv_heads * head_dim_, options, bias));
  wo_ = register_module("wo", std::make_shared<Linear>(n_heads * head_dim_, dim, options, bias));
  if (variant.qk_norm_eps) {
    q_norm_ = register_module("q_norm", std::make_shared<RMSNorm>(head_dim_, *variant.qk_norm_eps, options));
    k_norm_ = register_module("k_norm", std::make_shared<RMSNorm>(head_dim_, *variant.qk_norm_eps, options));
  }
  if (variant.sinks) enable_sinks(n_heads, options);
  set_sliding_window(variant.sliding_window);
}

void SelfAttention::enable_sinks(int64_t heads, const torch::TensorOptions& options) {
  LOOM_REQUIRE(sinks_ == nullptr, "attention sinks enabled twice");
  sinks_ = register_parameter("sinks", torch::empty({heads}, options));
}

void SelfAttention::set_sliding_window(int64_t window) {
  LOOM_REQUIRE(window >= 0, "sliding_window must be >= 0 (0: none), got ", window);
  sliding_window_ = window;
}

AttendFeatures SelfAttention::features() const {
  AttendFeatures f;
  if (sinks_ != nullptr) f.sinks = sinks_->tensor;
  f.sliding_window = sliding_window_;
  return f;
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> Attention::project_qkv(
    const torch::Tensor& x) {
  const int64_t batch = x.size(0);
  const int64_t seq = x.size(1);
  // Linear outputs are contiguous [B, T, heads * D], so these views are free. The head counts come
  // from the projections' outputs: under tensor parallelism each rank's wq/wk/wv hold only its
  // heads, and this module needs to know nothing about it.
  torch::Tensor q = wq_->forward(x);
  torch::Tensor k = wk_->forward(x);
  torch::Tensor v = wv_->forward(x);
  q = q.view({batch, seq, q.size(-1) / head_dim_, head_dim_});
  k = k.view({batch, seq, k.size(-1) / head_dim_, head_dim_});
  v = v.view({batch, seq, v.size(-1) / head_dim_, head_dim_});
  if (q_norm_) {
    // Per head, over head_dim; the weight is the same for every head (so also for this rank's
    // heads under tensor parallelism).
    q = q_norm_->forward(q);
    k = k_norm_->forward(k);
  }
  return {q, k, v};
}

const options::EnumNames<AttentionMask>& option_names(AttentionMask) {
  static const options::EnumNames<AttentionMask> names = {{"causal", AttentionMask::kCausal},
                                                          {"block_causal", AttentionMask::kBlockCausal}};
  return names;
}

torch::Tensor block_causal_mask(const torch::Tensor& document_ids) {
  const int64_t t = document_ids.size(1);
  const torch::Tensor causal = torch::ones({t, t}, document_ids.options().dtype(torch::kBool)).tril();
  return (document_ids.unsqueeze(2) == document_ids.unsqueeze(1)).logical_and(causal).unsqueeze(1);
}

torch::Tensor attention_mask(const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                             int64_t sliding_window, const torch::Tensor& q_documents,
                             const torch::Tensor& k_documents) {
  const torch::Tensor distance = q_positions.unsqueeze(1) - k_positions.unsqueeze(0);  // [Tq, Tk]
  torch::Tensor allowed = distance >= 0;
  if (sliding_window > 0) allowed = allowed.logical_and(distance < sliding_window);
  allowed = allowed.unsqueeze(0);  // [1, Tq, Tk]
  if (q_documents.defined()) {
    allowed = allowed.logical_and(q_documents.unsqueeze(2) == k_documents.unsqueeze(1));
  }
  return allowed.unsqueeze(1);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The sink's correction of a flash kernel's output o and log-sum-exp L over the keys (both the CPU
// and the CUDA path): L' = logaddexp(L, sink), out = o * exp(L - L'). Returns {out, L'}.
std::pair<torch::Tensor, torch::Tensor> sink_corrected(const torch::Tensor& o, const torch::Tensor& lse,
                                                       const torch::Tensor& sinks, c10::ScalarType dtype) {
  const torch::Tensor lse_all = torch::logaddexp(lse, sinks.to(torch::kFloat32).view({1, -1, 1}));  // [B, H, Tq]
  return {(o.to(torch::kFloat32) * (lse - lse_all).exp().unsqueeze(-1)).to(dtype), lse_all};
}

// d sink = sum over rows of -P_sink * (dout . out), P_sink = exp(sink - L').
torch::Tensor sink_gradient(const torch::Tensor& dout, const torch::Tensor& out, const torch::Tensor& sinks,
                            const torch::Tensor& lse_all) {
  const torch::Tensor row = (dout.to(torch::kFloat32) * out.to(torch::kFloat32)).sum(-1);  // [B, H, Tq]
  const torch::Tensor p_sink = (sinks.to(torch::kFloat32).view({1, -1, 1}) - lse_all).exp();
  return (-(p_sink * row)).sum({0, 2}).to(sinks.scalar_type());
}

// sink_attention on the CPU: the flash kernel's output o and log-sum-exp L over the keys; with the
// sink the denominator becomes exp(L) + exp(sink), so out = o * exp(L - L') with
// L' = logaddexp(L, sink). The sink is a key with logit `sink` and value 0, so flash attention's
// backward run with (out, L') gives the q, k, v gradients exactly, and the sink's gradient is
// d sink = sum over rows of -P_sink * (dout . out), P_sink = exp(sink - L').
struct SinkAttentionCPU : torch::autograd::Function<SinkAttentionCPU> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& sinks,
                               const std::optional<torch::Tensor>& mask, bool causal) {
    auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, mask);
    const auto [out, lse_all] = sink_corrected(o, lse, sinks, q.scalar_type());
    ctx->save_for_backward({q, k, v, sinks, out, lse_all});
    if (mask) ctx->saved_data["mask"] = *mask;
    ctx->saved_data["causal"] = causal;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &sinks = saved[3], &out = saved[4],
                        &lse_all = saved[5];
    std::optional<torch::Tensor> mask;
    if (ctx->saved_data.count("mask") > 0) mask = ctx->saved_data["mask"].toTensor();
    const bool causal = ctx->saved_data["causal"].toBool();
    const torch::Tensor dout = grads[0].contiguous();
    auto [dq, dk, dv] =
        at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse_all, 0.0, causal, mask);
    return {dq, dk, dv, sink_gradient(dout, out, sinks, lse_all), torch::Tensor(), torch::Tensor()};
  }
};

// sink_attention on CUDA in bf16 / fp16, causal or unmasked (GPT-OSS's full-attention layers, the
// ones whose [B, H, T, T] scores the explicit softmax below would hold: 4.3 GB a layer for one row
// of 4,096 tokens and 64 heads): the same correction as on the CPU, over CUDA's flash kernel, which
// returns its log-sum-exp too. The kernel wants as many key/value heads as query heads: each KV
// head is repeated for its query group, and its gradient is the sum over the group.
struct SinkAttentionFlashCUDA : torch::autograd::Function<SinkAttentionFlashCUDA> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& sinks, bool causal) {
    const int64_t groups = q.size(1) / k.size(1);
    const torch::Tensor keys = groups == 1 ? k : k.repeat_interleave(groups, 1);
    const torch::Tensor values = groups == 1 ? v : v.repeat_interleave(groups, 1);
    auto [o, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug_mask] =
        at::_scaled_dot_product_flash_attention(q, keys, values, 0.0, causal);
    (void)debug_mask;
    const auto [out, lse_all] = sink_corrected(o, lse, sinks, q.scalar_type());
    ctx->save_for_backward({q, keys, values, sinks, out, lse_all, cum_q, cum_k, seed, offset});
    ctx->saved_data["max_q"] = max_q.expect_int();
    ctx->saved_data["max_k"] = max_k.expect_int();
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["groups"] = groups;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &keys = saved[1], &values = saved[2], &sinks = saved[3], &out = saved[4],
                        &lse_all = saved[5];
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const torch::Tensor dout = grads[0].contiguous();
    auto [dq, dkeys, dvalues] = at::_scaled_dot_product_flash_attention_backward(
        dout, q, keys, values, out, lse_all, saved[6], saved[7], ctx->saved_data["max_q"].toInt(),
        ctx->saved_data["max_k"].toInt(), 0.0, ctx->saved_data["causal"].toBool(), saved[8], saved[9]);
    const auto fold = [&](const torch::Tensor& d) {  // [B, KV x groups, Tk, D] -> [B, KV, Tk, D]
      return groups == 1 ? d : d.unflatten(1, {d.size(1) / groups, groups}).sum(2);
    };
    return {dq, fold(dkeys), fold(dvalues), sink_gradient(dout, out, sinks, lse_all), torch::Tensor()};
  }
};

// Whether CUDA's flash kernel takes these: half precision, no mask beyond causal, a head size it
// has kernels for, query and key lengths equal under causal (its causal mask is top-left aligned).
bool flash_cuda_takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const std::optional<torch::Tensor>& mask, bool causal) {
  const auto dtype = q.scalar_type();
  return q.is_cuda() && !mask.has_value() && (dtype == torch::kBFloat16 || dtype == torch::kFloat16) &&
         k.scalar_type() == dtype && v.scalar_type() == dtype && q.size(-1) == v.size(-1) && q.size(-1) % 8 == 0 &&
         q.size(-1) <= 256 && (!causal || q.size(2) == k.size(2)) && q.size(1) % k.size(1) == 0;
}

// Any device: the explicit softmax over [scores, sink] in float32.
torch::Tensor sink_attention_math(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const std::optional<torch::Tensor>& mask, bool causal, const torch::Tensor& sinks) {
  const int64_t groups = q.size(1) / k.size(1);
  const torch::Tensor keys = groups == 1 ? k : k.repeat_interleave(groups, 1);
  const torch::Tensor values = groups == 1 ? v : v.repeat_interleave(groups, 1);
  torch::Tensor scores =
      torch::matmul(q.to(torch::kFloat32), keys.to(torch::kFloat32).transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  std::optional<torch::Tensor> allowed = mask;
  if (causal) allowed = torch::ones({q.size(2), k.size(2)}, q.options().dtype(torch::kBool)).tril();
  if (allowed) scores = scores.masked_fill(allowed->logical_not(), -std::numeric_limits<float>::infinity());
  const torch::Tensor sink = sinks.to(torch::kFloat32).view({1, -1, 1, 1}).expand({q.size(0), -1, q.size(2), 1});
  const torch::Tensor probs = torch::cat({scores, sink}, -1).softmax(-1).narrow(-1, 0, k.size(2));
  return torch::matmul(probs, values.to(torch::kFloat32)).to(q.scalar_type());
}

}  // namespace

torch::Tensor sink_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::optional<torch::Tensor>& mask, bool causal, const torch::Tensor& sinks) {
  LOOM_REQUIRE(sinks.defined() && sinks.dim() == 1 && sinks.size(0) == q.size(1), "sink_attention: sinks must be [",
               q.size(1), "] (one per query head), got ",
               sinks.defined() ? c10::str(sinks.sizes()) : std::string("none"));
  LOOM_REQUIRE(!(causal && mask.has_value()), "sink_attention: a mask or causal, not both");
  if (flash_cuda_takes(q, k, v, mask, causal)) return SinkAttentionFlashCUDA::apply(q, k, v, sinks, causal);
  if (!q.device().is_cpu()) return sink_attention_math(q, k, v, mask, causal, sinks);
  std::optional<torch::Tensor> additive;  // passed as a non-differentiable argument
  if (mask) {
    // The kernel's form: 0 where allowed, -inf elsewhere, in q's dtype, batch and query dims whole.
    const torch::Tensor allowed = mask->expand({q.size(0), 1, q.size(2), k.size(2)});
    additive = torch::zeros(allowed.sizes(), q.options())
                   .masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  return SinkAttentionCPU::apply(q, k, v, sinks, additive, causal);
}

torch::Tensor SelfAttention::attend(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const TokenLayout& layout) const {
  const AttendFeatures f = features();
  return attend_ ? attend_(q, k, v, layout, f) : sdpa_attend(q, k, v, layout, f);
}

torch::Tensor SelfAttention::sdpa_attend(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const TokenLayout& layout,
                                         const AttendFeatures& features) const {
  const int64_t batch = q.size(0);
  const int64_t seq = q.size(1);
  const int64_t heads = q.size(2);  // this rank's query heads (all of them without TP)
  // SDPA wants [B, heads, T, D]; the transposes are strided views the flash kernel reads directly.
  // Positions other than 0..T-1 (a context-parallel shard) need a backend that knows the other
  // ranks' keys; this one sees the whole row.
  LOOM_REQUIRE(!layout.positions.defined(),
               "Attention::attend without a backend needs tokens at positions 0..T-1");
  if (features.sinks.defined() || features.sliding_window > 0) {
    const torch::Tensor qt = q.transpose(1, 2), kt = k.transpose(1, 2), vt = v.transpose(1, 2);
    const torch::Tensor& docs = layout.document_ids;
    const int64_t window = features.sliding_window;
    const auto positions = torch::TensorOptions().dtype(torch::kInt64).device(q.device());
    // Queries [q0, q1) against keys [k0, q1).
    auto attend_range = [&](int64_t q0, int64_t q1, int64_t k0) {
      std::optional<torch::Tensor> mask;
      const bool plain_causal = window == 0 && !docs.defined();
      if (!plain_causal) {
        mask = attention_mask(torch::arange(q0, q1, positions), torch::arange(k0, q1, positions), window,
                              docs.defined() ? docs.narrow(1, q0, q1 - q0) : docs,
                              docs.defined() ? docs.narrow(1, k0, q1 - k0) : docs);
      }
      const torch::Tensor qs = qt.narrow(2, q0, q1 - q0), ks = kt.narrow(2, k0, q1 - k0),
                          vs = vt.narrow(2, k0, q1 - k0);
      if (features.sinks.defined()) return sink_attention(qs, ks, vs, mask, plain_causal, features.sinks);
      return at::scaled_dot_product_attention(qs, ks, vs, mask, 0.0, plain_causal, std::nullopt, heads != k.size(2));
    };
    const int64_t chunk = std::max(kWindowChunk, window);
    torch::Tensor out;
    if (window > 0 && seq > 2 * chunk) {
      std::vector<torch::Tensor> pieces;
      for (int64_t q0 = 0; q0 < seq; q0 += chunk) {
        const int64_t q1 = std::min(seq, q0 + chunk);
        pieces.push_back(attend_range(q0, q1, std::max<int64_t>(0, q0 - window + 1)));
      }
      out = torch::cat(pieces, 2);
    } else {
      out = attend_range(0, seq, 0);
    }
    return out.transpose(1, 2).reshape({batch, seq, heads * v.size(3)});
  }
  std::optional<torch::Tensor> mask;
  if (layout.document_ids.defined()) mask = block_causal_mask(layout.document_ids);
  torch::Tensor out = at::scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
      /*dropout_p=*/0.0, /*is_causal=*/!mask.has_value(), /*scale=*/std::nullopt,
      /*enable_gqa=*/heads != k.size(2));
  // The CPU/CUDA flash kernels allocate the output as [B, T, H, D] and return a transposed view,
  // so this reshape is a view, not a copy.
  return out.transpose(1, 2).reshape({batch, seq, heads * v.size(3)});
}

torch::Tensor Attention::forward(const torch::Tensor& x, const torch::Tensor& rope_cache, const TokenLayout& layout) {
  return call_with_hooks(x, [&](const torch::Tensor& in) {
    auto [q, k, v] = project_qkv(in);
    const torch::Tensor rope = layout.positions.defined() ? rope_cache.index_select(1, layout.positions) : rope_cache;
    q = apply_rotary_embedding(q, rope);
    k = apply_rotary_embedding(k, rope);
    return wo_->forward(attend(q, k, v, layout));
  });
}

}  // namespace loom::nn
