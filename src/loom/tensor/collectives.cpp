#include "loom/tensor/collectives.h"

#include "loom/core/error.h"

namespace loom::tensor {
namespace raw {
namespace {

int64_t normalized_dim(const torch::Tensor& t, int64_t dim) {
  const int64_t n = t.dim();
  LOOM_REQUIRE(dim >= -n && dim < n, "dim ", dim, " out of range for a ", n, "-D tensor");
  return dim < 0 ? dim + n : dim;
}

}  // namespace

torch::Tensor gather(const torch::Tensor& local, int64_t dim, distributed::Comm& comm) {
  if (comm.size() == 1) return local;
  dim = normalized_dim(local, dim);
  const int64_t t = comm.size();
  // The comm layer concatenates the ranks' contiguous tensors along dim 0: each rank sends its
  // piece as it is, into [t, *local] (no copy on the way in), and one copy puts the rank index
  // next to `dim`, so the result is contiguous (a strided view here would be copied again by every
  // matmul that reads it: three times for q, k, v).
  const torch::Tensor piece = local.contiguous();
  std::vector<int64_t> stacked = piece.sizes().vec();
  stacked.insert(stacked.begin(), t);
  torch::Tensor out = torch::empty(stacked, piece.options());
  comm.all_gather_into_tensor(out, piece);
  if (dim == 0) return out.flatten(0, 1);
  std::vector<int64_t> full = piece.sizes().vec();
  full[dim] *= t;
  return out.movedim(0, dim).reshape(full);
}

torch::Tensor reduce_scatter(const torch::Tensor& partial, int64_t dim, distributed::Comm& comm) {
  if (comm.size() == 1) return partial;
  dim = normalized_dim(partial, dim);
  const int64_t t = comm.size();
  LOOM_REQUIRE(partial.size(dim) % t == 0, "reduce_scatter along dim ", dim, " of size ",
               partial.size(dim), " over ", t, " ranks: not divisible");
  // Rank r's chunk along `dim` must be the r-th contiguous block: split `dim` into (t, size / t)
  // and bring t to the front (one copy); the chunk that comes back is then contiguous in the
  // original layout.
  std::vector<int64_t> split = partial.sizes().vec();
  split[dim] /= t;
  split.insert(split.begin() + dim, t);
  const torch::Tensor front = partial.reshape(split).movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = partial.sizes().vec();
  shape[dim] /= t;
  torch::Tensor out = torch::empty(shape, front.options());
  comm.reduce_scatter_tensor(out, front, distributed::ReduceOp::kSum);
  return out;
}

torch::Tensor sum(const torch::Tensor& partial, distributed::Comm& comm) {
  if (comm.size() == 1) return partial;
  torch::Tensor out = partial.clone(at::MemoryFormat::Contiguous);  // in place, not on the input
  comm.all_reduce(out, distributed::ReduceOp::kSum);
  return out;
}

torch::Tensor chunk(const torch::Tensor& replicated, int64_t dim, const distributed::Comm& comm) {
  if (comm.size() == 1) return replicated;
  dim = normalized_dim(replicated, dim);
  LOOM_REQUIRE(replicated.size(dim) % comm.size() == 0, "scatter along dim ", dim, " of size ",
               replicated.size(dim), " over ", comm.size(), " ranks: not divisible");
  const int64_t piece = replicated.size(dim) / comm.size();
  return replicated.narrow(dim, piece * comm.rank(), piece);
}

torch::Tensor all_to_all(const torch::Tensor& local, int64_t from_dim, int64_t to_dim, distributed::Comm& comm) {
  if (comm.size() == 1) return local;
  from_dim = normalized_dim(local, from_dim);
  to_dim = normalized_dim(local, to_dim);
  if (from_dim == to_dim) return local;
  const int w = comm.size();
  LOOM_REQUIRE(local.size(to_dim) % w == 0, "all_to_all to dim ", to_dim, " of size ",
               local.size(to_dim), " over ", w, " ranks: not divisible");
  // Piece j of this rank's tensor along to_dim goes to rank j; rank i's piece for this rank is
  // its slice of from_dim, so the received pieces concatenate along from_dim in rank order.
  const torch::Tensor send = torch::stack(local.chunk(w, to_dim), 0).contiguous();
  torch::Tensor recv = torch::empty_like(send);
  comm.all_to_all(recv, send);
  return torch::cat(recv.unbind(0), from_dim);
}

}  // namespace raw

namespace {

// The comm travels with the autograd node: a capsule is the IValue that holds any C++ object.
struct CommCapsule : torch::CustomClassHolder {
  explicit CommCapsule(CommPtr c) : comm(std::move(c)) {}
  CommPtr comm;
};

}  // namespace

void save_comm(torch::autograd::AutogradContext* ctx, const CommPtr& comm) {
  LOOM_REQUIRE(comm != nullptr, "collective without a comm");
  ctx->saved_data["comm"] = c10::IValue::make_capsule(c10::make_intrusive<CommCapsule>(comm));
}

distributed::Comm& saved_comm(torch::autograd::AutogradContext* ctx) {
  return *c10::static_intrusive_pointer_cast<CommCapsule>(ctx->saved_data["comm"].toCapsule())->comm;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t dim,
                               const CommPtr& comm, bool partial_grad) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["partial"] = partial_grad;
    return raw::gather(x, dim, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    distributed::Comm& comm = saved_comm(ctx);
    torch::Tensor grad = ctx->saved_data["partial"].toBool() ? raw::reduce_scatter(g[0], dim, comm)
                                                             : raw::chunk(g[0], dim, comm).contiguous();
    return {grad, {}, {}, {}};
  }
};

struct ReduceScatterFn : torch::autograd::Function<ReduceScatterFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t dim, const CommPtr& comm) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    return raw::reduce_scatter(x, dim, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {raw::gather(g[0], ctx->saved_data["dim"].toInt(), saved_comm(ctx)), {}, {}};
  }
};

struct AllReduceFn : torch::autograd::Function<AllReduceFn> {
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x, const CommPtr& comm) {
    return raw::sum(x, *comm);
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list g) { return {g[0], {}}; }
};

struct AllReduceInBackwardFn : torch::autograd::Function<AllReduceInBackwardFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const CommPtr& comm) {
    save_comm(ctx, comm);
    return x.view_as(x);  // a new autograd node over the same values
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {raw::sum(g[0], saved_comm(ctx)), {}};
  }
};

struct ScatterFn : torch::autograd::Function<ScatterFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t dim, const CommPtr& comm) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    return raw::chunk(x, dim, *comm).clone();  // own storage: the full input may be freed
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {raw::gather(g[0], ctx->saved_data["dim"].toInt(), saved_comm(ctx)), {}, {}};
  }
};

struct AllToAllFn : torch::autograd::Function<AllToAllFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t from_dim,
                               int64_t to_dim, const CommPtr& comm) {
    save_comm(ctx, comm);
    ctx->saved_data["from"] = from_dim;
    ctx->saved_data["to"] = to_dim;
    return raw::all_to_all(x, from_dim, to_dim, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {raw::all_to_all(g[0], ctx->saved_data["to"].toInt(), ctx->saved_data["from"].toInt(),
                            saved_comm(ctx)),
            {}, {}, {}};
  }
};

torch::Tensor exchange_rows(const torch::Tensor& rows, const std::vector<int64_t>& output_splits,
                            const std::vector<int64_t>& input_splits, distributed::Comm& comm) {
  int64_t out_rows = 0;
  for (int64_t n : output_splits) out_rows += n;
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = out_rows;
  const torch::Tensor input = rows.contiguous();
  torch::Tensor out = torch::empty(shape, input.options());
  comm.all_to_all(out, input, output_splits, input_splits);
  return out;
}

struct AllToAllRowsFn : torch::autograd::Function<AllToAllRowsFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const std::vector<int64_t>& output_splits,
                               const std::vector<int64_t>& input_splits, const CommPtr& comm) {
    save_comm(ctx, comm);
    ctx->saved_data["out"] = output_splits;
    ctx->saved_data["in"] = input_splits;
    return exchange_rows(x, output_splits, input_splits, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const std::vector<int64_t> out = ctx->saved_data["out"].toIntVector();
    const std::vector<int64_t> in = ctx->saved_data["in"].toIntVector();
    return {exchange_rows(g[0], in, out, saved_comm(ctx)), {}, {}, {}};
  }
};

}  // namespace

torch::Tensor all_to_all_rows(const torch::Tensor& rows, const std::vector<int64_t>& output_splits,
                              const std::vector<int64_t>& input_splits, const CommPtr& comm) {
  LOOM_REQUIRE(static_cast<int>(output_splits.size()) == comm->size() &&
                   static_cast<int>(input_splits.size()) == comm->size(),
               "all_to_all_rows over ", comm->describe(), " needs one split per rank, got ", output_splits.size(),
               " and ", input_splits.size());
  if (comm->size() == 1) return rows;
  return AllToAllRowsFn::apply(rows, output_splits, input_splits, comm);
}

torch::Tensor all_gather(const torch::Tensor& local, int64_t dim, const CommPtr& comm,
                         ReplicatedGrad grad) {
  return comm->size() == 1 ? local
                           : AllGatherFn::apply(local, dim, comm, grad == ReplicatedGrad::kPartial);
}
torch::Tensor reduce_scatter(const torch::Tensor& partial, int64_t dim, const CommPtr& comm) {
  return comm->size() == 1 ? partial : ReduceScatterFn::apply(partial, dim, comm);
}
torch::Tensor all_reduce(const torch::Tensor& partial, const CommPtr& comm) {
  return comm->size() == 1 ? partial : AllReduceFn::apply(partial, comm);
}
torch::Tensor all_reduce_in_backward(const torch::Tensor& replicated, const CommPtr& comm) {
  return comm->size() == 1 ? replicated : AllReduceInBackwardFn::apply(replicated, comm);
}
torch::Tensor scatter(const torch::Tensor& replicated, int64_t dim, const CommPtr& comm) {
  return comm->size() == 1 ? replicated : ScatterFn::apply(replicated, dim, comm);
}
torch::Tensor all_to_all(const torch::Tensor& local, int64_t from_dim, int64_t to_dim, const CommPtr& comm) {
  return comm->size() == 1 ? local : AllToAllFn::apply(local, from_dim, to_dim, comm);
}

torch::Tensor redistribute(const torch::Tensor& local, const Placement& from, const Placement& to,
                           const CommPtr& comm, ReplicatedGrad grad) {
  if (from == to) return local;
  const auto* from_shard = std::get_if<Shard>(&from);
  const auto* to_shard = std::get_if<Shard>(&to);
  const bool from_partial = std::holds_alternative<Partial>(from);
  const bool from_replicate = std::holds_alternative<Replicate>(from);
  const bool to_replicate = std::holds_alternative<Replicate>(to);
  if (from_shard && to_replicate) return all_gather(local, from_shard->dim, comm, grad);
  if (from_shard && to_shard) return all_to_all(local, from_shard->dim, to_shard->dim, comm);
  if (from_partial && to_replicate) return all_reduce(local, comm);
  if (from_partial && to_shard) return reduce_scatter(local, to_shard->dim, comm);
  if (from_replicate && to_shard) return scatter(local, to_shard->dim, comm);
  fail("redistribute from ", to_string(from), " to ", to_string(to), " is not supported");
}

}  // namespace loom::tensor
