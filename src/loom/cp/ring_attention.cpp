#include "loom/cp/ring_attention.h"

#include <functional>
#include <limits>

#include "loom/core/error.h"

namespace loom::cp {

const options::EnumNames<RotateMethod>& option_names(RotateMethod) {
  static const options::EnumNames<RotateMethod> names = {{"allgather", RotateMethod::kAllGather},
                                                         {"ring", RotateMethod::kRing}};
  return names;
}

std::vector<int64_t> chunk_ids(int rank, int degree) { return {rank, 2 * degree - 1 - rank}; }

torch::Tensor shard_sequence(const torch::Tensor& full, int64_t dim, int rank, int degree) {
  const int64_t d = dim < 0 ? dim + full.dim() : dim;
  LOOM_REQUIRE_USAGE(full.size(d) % (2 * degree) == 0, "context parallel degree ", degree,
                     " needs the sequence length to be divisible by 2 x ", degree, " = ", 2 * degree,
                     ", got ", full.size(d), "; change training.seq_len");
  const int64_t n = full.size(d) / (2 * degree);
  std::vector<torch::Tensor> pieces;
  for (int64_t c : chunk_ids(rank, degree)) pieces.push_back(full.narrow(d, c * n, n));
  return torch::cat(pieces, d);
}

torch::Tensor sequence_positions(int64_t seq_len, int rank, int degree) {
  return shard_sequence(torch::arange(seq_len, torch::kInt64), 0, rank, degree);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One block of flash attention with its log-sum-exp: queries of one local chunk against one key
// chunk, fully (the keys are all earlier) or causally (the same chunk).
struct BlockResult {
  torch::Tensor out, lse;  // [B, H, n, D], [B, H, n] (float32)
};

void require_supported(const torch::Tensor& q) {
  LOOM_REQUIRE_USAGE(q.device().is_cpu(), "context parallel attention runs on the CPU only so far (got ",
                     q.device(), "); set parallelism.context_parallel_degree = 1 on this device");
}

// Which (query, key) pairs of a block may attend, with document masking and/or a sliding window
// cutting through it: [B or 1, n, n] bool, or undefined when the block has neither to respect
// (plain causal / full).
struct BlockMask {
  torch::Tensor allowed;   // [B, n, n]
  torch::Tensor additive;  // [B, 1, n, n]: 0 where allowed, -inf elsewhere (the kernel's form)
  torch::Tensor empty_rows;  // [B, 1, n]: query rows with no allowed key
  bool any = true;
};

// The blocks between this rank's query chunks and the key chunks of rank `src`.
struct Block {
  int query_half;  // 0: the early chunk (rank), 1: the late one (2c-1-rank)
  int key_half;    // of src's key/value tensors
  bool causal;
  // Some of its (query, key) pairs lie beyond the sliding window: masked by position.
  bool windowed = false;
  int64_t query_start = 0, key_start = 0;  // global positions of the chunks' first tokens
};

BlockMask block_mask(const torch::Tensor& q_docs, const torch::Tensor& k_docs, const Block& b, int64_t n,
                     int64_t window, int64_t batch, const torch::TensorOptions& options) {
  BlockMask m;
  if (!q_docs.defined() && !b.windowed) return m;
  // By global position: key <= query (all of an earlier chunk, the causal triangle of the same
  // one), within the window when it cuts the block.
  const torch::Tensor distance = torch::arange(b.query_start, b.query_start + n, torch::kInt64).unsqueeze(1) -
                                 torch::arange(b.key_start, b.key_start + n, torch::kInt64).unsqueeze(0);
  torch::Tensor allowed = distance >= 0;
  if (b.windowed) allowed = allowed.logical_and(distance < window);
  m.allowed = allowed.unsqueeze(0);
  if (q_docs.defined()) m.allowed = m.allowed.logical_and(q_docs.unsqueeze(2) == k_docs.unsqueeze(1));
  m.any = m.allowed.any().item<bool>();
  m.additive = torch::zeros({batch, n, n}, options)
                   .masked_fill(m.allowed.logical_not(), -std::numeric_limits<double>::infinity())
                   .unsqueeze(1);
  m.empty_rows = m.allowed.any(-1).logical_not().unsqueeze(1);
  return m;
}

BlockResult attend_block(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                         const BlockMask& mask) {
  if (!mask.allowed.defined()) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal);
    return {out, lse};
  }
  // The mask holds the causal part; the kernel leaves rows with no allowed key at out 0 and
  // log-sum-exp 0, which must weigh nothing in the merge: -inf.
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false, mask.additive);
  return {out, lse.masked_fill(mask.empty_rows, -std::numeric_limits<double>::infinity())};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> attend_block_backward(
    const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& out, const torch::Tensor& lse, bool causal, const BlockMask& mask) {
  if (!mask.allowed.defined()) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal);
  }
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, false,
                                                                   mask.additive);
}

// Per (query chunk x, key chunk m) of n tokens: m > x is never seen; with a sliding window of w
// tokens, a block whose nearest pair is w or more apart ((x - m - 1) n + 1 >= w) is skipped, and
// one whose farthest pair is ((x - m + 1) n - 1 >= w) is masked by position.
std::vector<Block> blocks_with(int rank, int src, int degree, int64_t n, int64_t window) {
  const auto queries = chunk_ids(rank, degree), keys = chunk_ids(src, degree);
  std::vector<Block> blocks;
  for (int kh = 0; kh < 2; ++kh) {
    for (int qh = 0; qh < 2; ++qh) {
      const int64_t x = queries[qh], m = keys[kh];
      if (m > x) continue;
      const int64_t nearest = m == x ? 0 : (x - m - 1) * n + 1, farthest = (x - m + 1) * n - 1;
      if (window > 0 && nearest >= window) continue;
      blocks.push_back({qh, kh, m == x, window > 0 && farthest >= window, x * n, m * n});
    }
  }
  return blocks;
}

// Running merge of one query chunk's partial results.
struct Merged {
  torch::Tensor out, lse;
  void add(const BlockResult& b) {
    if (!out.defined()) {
      out = b.out.to(torch::kFloat32);
      lse = b.lse;
      return;
    }
    const torch::Tensor new_lse = torch::logaddexp(lse, b.lse);
    // Rows where both are -inf (no allowed key yet, document masking) stay 0 / -inf, not NaN.
    auto weight = [&](const torch::Tensor& part) { return (part - new_lse).exp().nan_to_num(0.0).unsqueeze(-1); };
    out = out * weight(lse) + b.out.to(torch::kFloat32) * weight(b.lse);
    lse = new_lse;
  }
};

torch::Tensor half(const torch::Tensor& t, int h) {
  const int64_t n = t.size(2) / 2;
  return t.narrow(2, h * n, n);
}

// Document ids [B, T] of one half of the local tokens (undefined stays undefined).
torch::Tensor doc_half(const torch::Tensor& docs, int h) {
  if (!docs.defined()) return docs;
  const int64_t n = docs.size(1) / 2;
  return docs.narrow(1, h * n, n);
}

// Every rank's document ids [t, B, T] (small: once per call), so each block knows its keys'.
torch::Tensor gather_documents(const torch::Tensor& docs, distributed::Comm& comm) {
  if (!docs.defined()) return docs;
  if (comm.size() == 1) return docs.unsqueeze(0);
  const torch::Tensor local = docs.contiguous();
  torch::Tensor all = torch::empty({comm.size(), local.size(0), local.size(1)}, local.options());
  comm.all_gather_into_tensor(all, local);
  return all;
}

// Calls visit(src, kv) for the key/values [2, B, Hkv, T, D] of every rank, this rank's first, then
// around the ring (src = rank - j), fetched as `method` says.
void for_each_source(const torch::Tensor& kv, distributed::Comm& comm, RotateMethod method,
                     const std::function<void(int src, const torch::Tensor& kv)>& visit) {
  const int t = comm.size(), r = comm.rank();
  if (method == RotateMethod::kAllGather && t > 1) {
    torch::Tensor all = torch::empty({t * kv.size(0), kv.size(1), kv.size(2), kv.size(3), kv.size(4)}, kv.options());
    comm.all_gather_into_tensor(all, kv);
    for (int j = 0; j < t; ++j) {
      const int src = (r - j + t) % t;
      visit(src, all.narrow(0, 2 * src, 2));
    }
    return;
  }
  torch::Tensor current = kv;
  for (int j = 0; j < t; ++j) {
    distributed::RingStep x;
    torch::Tensor next;
    if (j + 1 < t) {
      next = torch::empty_like(current);
      x = distributed::ring_step(comm, current, next, j);
    }
    visit((r - j + t) % t, current);
    x.wait();
    current = next;
  }
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const tensor::CommPtr& comm, int64_t method,
                               const std::optional<torch::Tensor>& document_ids, const torch::Tensor& sinks,
                               int64_t window) {
    const torch::Tensor documents = document_ids.value_or(torch::Tensor());
    distributed::Comm& group = *comm;
    const int t = group.size(), r = group.rank();
    const torch::Tensor kv = torch::stack({k, v}).contiguous();
    const torch::Tensor all_docs = gather_documents(documents, group);
    const int64_t n = q.size(2) / 2;
    Merged merged[2];
    for_each_source(kv, group, static_cast<RotateMethod>(method), [&](int src, const torch::Tensor& pair) {
      for (const Block& b : blocks_with(r, src, t, n, window)) {
        const BlockMask mask = block_mask(doc_half(documents, b.query_half),
                                          all_docs.defined() ? doc_half(all_docs[src], b.key_half) : all_docs, b, n,
                                          window, q.size(0), q.options());
        if (!mask.any) continue;
        merged[b.query_half].add(attend_block(half(q, b.query_half), half(pair[0], b.key_half),
                                              half(pair[1], b.key_half), b.causal, mask));
      }
    });
    torch::Tensor out = torch::cat({merged[0].out, merged[1].out}, 2);
    torch::Tensor lse = torch::cat({merged[0].lse, merged[1].lse}, 2);
    if (sinks.numel() > 0) {
      // The sinks join the merged softmax once: one more term exp(sink) in each row's denominator.
      // The blocks' backward then runs on this output and log-sum-exp, which is exact (a sink is a
      // key with value 0).
      const torch::Tensor with_sink = torch::logaddexp(lse, sinks.to(torch::kFloat32).view({1, -1, 1}));
      out = out * (lse - with_sink).exp().unsqueeze(-1);
      lse = with_sink;
    }
    out = out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, sinks});
    ctx->saved_data["window"] = window;
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["method"] = method;
    if (documents.defined()) {
      ctx->saved_data["documents"] = documents;
      ctx->saved_data["all_documents"] = all_docs;
    }
    tensor::save_comm(ctx, comm);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &sinks = saved[4];
    const int64_t window = ctx->saved_data["window"].toInt();
    const int64_t n = q.size(2) / 2;
    const torch::Tensor lse = ctx->saved_data["lse"].toTensor();
    const auto method = static_cast<RotateMethod>(ctx->saved_data["method"].toInt());
    const bool masked = ctx->saved_data.count("documents") > 0;
    const torch::Tensor documents = masked ? ctx->saved_data["documents"].toTensor() : torch::Tensor();
    const torch::Tensor all_docs = masked ? ctx->saved_data["all_documents"].toTensor() : torch::Tensor();
    distributed::Comm& group = tensor::saved_comm(ctx);
    const int t = group.size(), r = group.rank();
    const torch::Tensor dout = grads[0].contiguous();
    torch::Tensor dq = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat32));
    const torch::Tensor kv = torch::stack({k, v}).contiguous();
    // The key/value gradients of every source's blocks, in float32: [t, 2, B, Hkv, T, D] for the
    // reduce-scatter (allgather) or one source's at a time travelling home (ring).
    auto contributions = [&](int src, const torch::Tensor& pair) {
      torch::Tensor dkv = torch::zeros(pair.sizes(), pair.options().dtype(torch::kFloat32));
      for (const Block& b : blocks_with(r, src, t, n, window)) {
        const BlockMask mask = block_mask(doc_half(documents, b.query_half),
                                          all_docs.defined() ? doc_half(all_docs[src], b.key_half) : all_docs, b, n,
                                          window, q.size(0), q.options());
        if (!mask.any) continue;
        auto [dq_b, dk_b, dv_b] = attend_block_backward(
            half(dout, b.query_half), half(q, b.query_half), half(pair[0], b.key_half),
            half(pair[1], b.key_half), half(out, b.query_half), half(lse, b.query_half), b.causal, mask);
        half(dq, b.query_half).add_(dq_b);
        half(dkv[0], b.key_half).add_(dk_b);
        half(dkv[1], b.key_half).add_(dv_b);
      }
      return dkv;
    };
    torch::Tensor dkv_own;
    if (method == RotateMethod::kAllGather && t > 1) {
      torch::Tensor all = torch::zeros({t * 2, kv.size(1), kv.size(2), kv.size(3), kv.size(4)},
                                       kv.options().dtype(torch::kFloat32));
      for_each_source(kv, group, method, [&](int src, const torch::Tensor& pair) {
        all.narrow(0, 2 * src, 2).copy_(contributions(src, pair));
      });
      dkv_own = torch::empty(kv.sizes(), all.options());
      group.reduce_scatter_tensor(dkv_own, all);
    } else {
      // The gradient of each source's keys and values travels with them around the ring, each rank
      // adding its blocks' share; after a full turn it arrives at its owner.
      distributed::RingStep home;
      torch::Tensor sending, arriving;
      int step = 0;
      for_each_source(kv, group, method, [&](int src, const torch::Tensor& pair) {
        torch::Tensor dkv = contributions(src, pair);
        if (step > 0) {
          home.wait();
          dkv.add_(arriving);
        }
        sending = dkv;
        if (t > 1) {
          arriving = torch::empty_like(dkv);
          home = distributed::ring_step(group, sending, arriving, 1000 + step);
        } else {
          arriving = dkv;
        }
        ++step;
      });
      home.wait();
      dkv_own = arriving;
    }
    // The sinks' gradient from this rank's query rows (summed over the ranks like every replicated
    // parameter's): d sink = -sum_rows P_sink (dout . out), P_sink = exp(sink - lse).
    torch::Tensor dsinks;
    if (sinks.numel() > 0) {
      const torch::Tensor row = (dout.to(torch::kFloat32) * out.to(torch::kFloat32)).sum(-1);
      const torch::Tensor p_sink = (sinks.to(torch::kFloat32).view({1, -1, 1}) - lse).exp();
      dsinks = (-(p_sink * row)).sum({0, 2}).to(sinks.scalar_type());
    }
    return {dq.to(q.scalar_type()), dkv_own[0].to(k.scalar_type()), dkv_own[1].to(v.scalar_type()), {}, {}, {},
            dsinks, {}};
  }
};

}  // namespace

torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const tensor::CommPtr& comm, RotateMethod method, const torch::Tensor& document_ids,
                             const torch::Tensor& sinks, int64_t sliding_window) {
  LOOM_REQUIRE(comm != nullptr, "ring_attention needs a comm");
  require_supported(q);
  LOOM_REQUIRE(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                   q.size(2) == k.size(2) && q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
               "ring_attention needs q [B, Hq, T, D] and k, v [B, Hkv, T, D] with Hkv dividing Hq, got ",
               q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  LOOM_REQUIRE(q.size(2) % 2 == 0, "ring_attention: the local sequence holds two equal chunks, got length ",
               q.size(2));
  LOOM_REQUIRE(!document_ids.defined() || (document_ids.dim() == 2 && document_ids.size(0) == q.size(0) &&
                                            document_ids.size(1) == q.size(2)),
               "ring_attention: document ids must be [batch, local tokens] = [", q.size(0), ", ", q.size(2),
               "], got ", document_ids.sizes());
  LOOM_REQUIRE(!sinks.defined() || (sinks.dim() == 1 && sinks.size(0) == q.size(1)),
               "ring_attention: sinks must be [", q.size(1), "] (one per query head), got ", sinks.sizes());
  LOOM_REQUIRE(sliding_window >= 0, "ring_attention: sliding_window must be >= 0 (0: none), got ", sliding_window);
  // Passed as a non-differentiable argument (an int64 tensor has no gradient).
  std::optional<torch::Tensor> documents;
  if (document_ids.defined()) documents = document_ids.to(torch::kInt64);
  // Without sinks an empty tensor stands in (an autograd input must be defined).
  return RingAttention::apply(q, k, v, comm, static_cast<int64_t>(method), documents,
                              sinks.defined() ? sinks : torch::empty({0}, q.options()), sliding_window);
}

}  // namespace loom::cp
