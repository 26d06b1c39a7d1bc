#include "loom/tp/collective_matmul.h"

#include <functional>

#include "loom/core/error.h"

namespace loom::tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Activations are [batch, seq, features]; the chunks travel along the sequence.
constexpr int64_t kSeq = 1;

int64_t sequence_dim(const torch::Tensor& t, int64_t dim) {
  LOOM_REQUIRE(t.dim() == 3, "collective matmuls take [batch, seq, features] activations, got ", t.sizes());
  const int64_t d = dim < 0 ? dim + t.dim() : dim;
  LOOM_REQUIRE(d == kSeq, "collective matmuls split the sequence (dim 1), got dim ", dim);
  return d;
}

// out[b] = a[b] @ w for every batch row; `out` may be a slice along the sequence of a larger tensor
// (each out[b] is then a contiguous 2-D block), so no result is copied.
void batched_mm_into(const torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& w, bool accumulate) {
  for (int64_t b = 0; b < a.size(0); ++b) {
    torch::Tensor o = out[b];
    if (accumulate) {
      o.addmm_(a[b], w);
    } else {
      at::mm_out(o, a[b], w);
    }
  }
}

// Gathers `local` ([b, n, f], this rank's chunk) along the sequence around the ring. `on_chunk`
// runs on each chunk as soon as it is here (the local one first), with the chunk's sequence
// offset, while the next chunk is in flight. Returns the gathered [b, t*n, f].
torch::Tensor ring_all_gather(const torch::Tensor& local, distributed::Comm& comm,
                              const std::function<void(int64_t offset, const torch::Tensor& chunk)>& on_chunk) {
  const int t = comm.size(), r = comm.rank();
  const int64_t n = local.size(kSeq);
  std::vector<int64_t> sizes = local.sizes().vec();
  sizes[kSeq] *= t;
  torch::Tensor full = torch::empty(sizes, local.options());
  torch::Tensor current = local.contiguous();
  for (int j = 0; j < t; ++j) {
    const int src = (r - j + t) % t;  // whose chunk `current` is
    distributed::RingStep ring;
    torch::Tensor incoming;
    if (j + 1 < t) {
      incoming = torch::empty_like(current);
      ring = distributed::ring_step(comm, current, incoming, j);
    }
    full.narrow(kSeq, src * n, n).copy_(current);
    on_chunk(src * n, current);
    ring.wait_recv();
    ring.wait_send();
    current = incoming;
  }
  return full;
}

// Reduce-scatter along the sequence around the ring: `partial(c)` returns this rank's addend for
// chunk c (a new contiguous tensor of `chunk_sizes`), computed while the running sum of the
// previous chunk travels. The sum for chunk r ends on rank r and is returned. `before_last_wait`
// (optional) runs while the last transfer is in flight: work that needs no result of the ring.
torch::Tensor ring_reduce_scatter(const std::vector<int64_t>& chunk_sizes, const torch::TensorOptions& options,
                                  distributed::Comm& comm, const std::function<torch::Tensor(int c)>& partial,
                                  const std::function<void()>& before_last_wait) {
  const int t = comm.size(), r = comm.rank();
  torch::Tensor sending, result;
  distributed::WorkHandle send;
  for (int j = 0; j < t; ++j) {
    const int c = ((r - 1 - j) % t + t) % t;  // the chunk the ring carries through this rank now
    distributed::RingStep ring;
    torch::Tensor incoming;
    // The running sum of chunk c, from the previous rank (its step j - 1), and this rank's addend.
    if (j > 0) {
      incoming = torch::empty(chunk_sizes, options);
      ring = distributed::ring_step(comm, torch::Tensor(), incoming, j - 1);
    }
    torch::Tensor sum = partial(c);
    if (j + 1 == t && before_last_wait) before_last_wait();
    if (j > 0) {
      ring.wait_recv();
      sum.add_(incoming);
    }
    if (j + 1 < t) {
      if (send) send->wait();
      sending = sum;
      send = distributed::ring_step(comm, sending, torch::Tensor(), j).send;
    } else {
      result = sum;
    }
  }
  if (send) send->wait();
  return result;
}

struct AllGatherMatmul : torch::autograd::Function<AllGatherMatmul> {
  // The sequence dim is kSeq (the public functions check it).
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& local, at::TensorList weights,
                               const tensor::CommPtr& comm) {
    const int64_t n = local.size(kSeq);
    std::vector<torch::Tensor> outputs;
    for (const auto& w : weights) {
      outputs.push_back(torch::empty({local.size(0), n * comm->size(), w.size(0)}, local.options()));
    }
    torch::Tensor full = ring_all_gather(local, *comm, [&](int64_t offset, const torch::Tensor& chunk) {
      for (size_t i = 0; i < weights.size(); ++i) {
        batched_mm_into(outputs[i].narrow(kSeq, offset, n), chunk, weights[i].t(), false);
      }
    });
    // The gathered input is an output of this node: saved through save_for_backward, which keeps
    // outputs without a reference cycle (saved_data would hold the node through its grad_fn).
    std::vector<torch::Tensor> to_save = weights.vec();
    to_save.push_back(full);
    ctx->save_for_backward(to_save);
    tensor::save_comm(ctx, comm);
    variable_list result{full};
    result.insert(result.end(), outputs.begin(), outputs.end());
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    std::vector<torch::Tensor> weights = ctx->get_saved_variables();
    const torch::Tensor full = weights.back();
    weights.pop_back();
    distributed::Comm& comm = tensor::saved_comm(ctx);
    const int t = comm.size();
    const int64_t n = full.size(kSeq) / t;
    const torch::Tensor g_full = grads[0];
    std::vector<torch::Tensor> g_out(weights.size());
    for (size_t i = 0; i < weights.size(); ++i) {
      if (grads[i + 1].defined()) g_out[i] = grads[i + 1].contiguous();
    }
    variable_list result(1 + weights.size() + 1);  // local, weights, comm
    auto weight_grads = [&] {
      const torch::Tensor x = full.reshape({-1, full.size(-1)});
      for (size_t i = 0; i < weights.size(); ++i) {
        if (g_out[i].defined()) result[1 + i] = g_out[i].reshape({-1, g_out[i].size(-1)}).t().mm(x);
      }
    };
    // Input gradient: this rank's addend of chunk c is sum_i dy_i[c] @ W_i (+ the gathered
    // input's own gradient, if it had other users); the ring sums the ranks' addends.
    const std::vector<int64_t> chunk_sizes{full.size(0), n, full.size(2)};
    result[0] = ring_reduce_scatter(chunk_sizes, full.options(), comm, [&](int c) {
      torch::Tensor p;  // a new tensor: the ring adds into it
      if (g_full.defined()) p = g_full.narrow(kSeq, c * n, n).clone(at::MemoryFormat::Contiguous);
      for (size_t i = 0; i < weights.size(); ++i) {
        if (!g_out[i].defined()) continue;
        const bool accumulate = p.defined();
        if (!accumulate) p = torch::empty(chunk_sizes, full.options());
        batched_mm_into(p, g_out[i].narrow(kSeq, c * n, n), weights[i], accumulate);
      }
      return p.defined() ? p : torch::zeros(chunk_sizes, full.options());
    }, weight_grads);
    return result;
  }
};

struct MatmulReduceScatter : torch::autograd::Function<MatmulReduceScatter> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, const torch::Tensor& weight,
                               const tensor::CommPtr& comm) {
    const torch::Tensor x = input.contiguous();
    const int t = comm->size();
    const int64_t n = x.size(kSeq) / t;
    const std::vector<int64_t> chunk_sizes{x.size(0), n, weight.size(0)};
    const torch::Tensor wt = weight.t();
    torch::Tensor out = ring_reduce_scatter(chunk_sizes, x.options(), *comm, [&](int c) {
      torch::Tensor p = torch::empty(chunk_sizes, x.options());
      batched_mm_into(p, x.narrow(kSeq, c * n, n), wt, false);
      return p;
    }, nullptr);
    ctx->save_for_backward({x, weight});
    tensor::save_comm(ctx, comm);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& weight = saved[1];
    distributed::Comm& comm = tensor::saved_comm(ctx);
    const torch::Tensor g = grads[0].contiguous();
    const int64_t n = g.size(kSeq);
    // Input gradient dy @ W, chunk by chunk as dy's chunks arrive; then the weight gradient from
    // the gathered dy in one GEMM.
    torch::Tensor grad_input = torch::empty(x.sizes(), x.options());
    const torch::Tensor g_full = ring_all_gather(g, comm, [&](int64_t offset, const torch::Tensor& chunk) {
      batched_mm_into(grad_input.narrow(kSeq, offset, n), chunk, weight, false);
    });
    torch::Tensor grad_weight = g_full.reshape({-1, g_full.size(-1)}).t().mm(x.reshape({-1, x.size(-1)}));
    return {grad_input, grad_weight, {}};
  }
};

}  // namespace

GatheredMatmul all_gather_matmul(const torch::Tensor& local, const std::vector<torch::Tensor>& weights,
                                 int64_t dim, const tensor::CommPtr& comm) {
  LOOM_REQUIRE(comm != nullptr, "all_gather_matmul needs a comm");
  sequence_dim(local, dim);  // only the sequence dim is supported
  LOOM_REQUIRE(!weights.empty(), "all_gather_matmul needs at least one weight");
  for (const auto& w : weights) {
    LOOM_REQUIRE(w.dim() == 2 && w.size(1) == local.size(-1), "all_gather_matmul: weight ", w.sizes(),
                 " does not take inputs of ", local.size(-1), " features");
  }
  variable_list out = AllGatherMatmul::apply(local, at::TensorList(weights), comm);
  GatheredMatmul result;
  result.input = out[0];
  result.outputs.assign(out.begin() + 1, out.end());
  return result;
}

torch::Tensor matmul_reduce_scatter(const torch::Tensor& input, const torch::Tensor& weight, int64_t dim,
                                    const tensor::CommPtr& comm) {
  LOOM_REQUIRE(comm != nullptr, "matmul_reduce_scatter needs a comm");
  const int64_t d = sequence_dim(input, dim);
  LOOM_REQUIRE(weight.dim() == 2 && weight.size(1) == input.size(-1), "matmul_reduce_scatter: weight ",
               weight.sizes(), " does not take inputs of ", input.size(-1), " features");
  LOOM_REQUIRE(input.size(d) % comm->size() == 0, "matmul_reduce_scatter: sequence length ", input.size(d),
               " is not divisible by the group size ", comm->size());
  return MatmulReduceScatter::apply(input, weight, comm);
}

}  // namespace loom::tp
