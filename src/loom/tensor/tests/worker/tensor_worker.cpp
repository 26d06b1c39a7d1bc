// Per-rank scenarios for the tensor multi-rank tests, started as
//   loom launch --nproc N --exec -- loom_tensor_worker <scenario>...
// Each rank checks forward values and gradients of the autograd collectives against what the
// single-process computation gives, and exits 1 with one line naming the rank and the mismatch.
#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "loom/core/error.h"
#include "loom/tensor/collectives.h"
#include "loom/testing/worker.h"

namespace {

using loom::tensor::CommPtr;
namespace lt = loom::tensor;

void expect_equal(const torch::Tensor& actual, const torch::Tensor& expected, const std::string& what) {
  LOOM_REQUIRE(actual.sizes() == expected.sizes(), what, ": shape ", actual.sizes(), " expected ",
               expected.sizes());
  LOOM_REQUIRE(torch::equal(actual.contiguous(), expected.contiguous()), what, ": max |diff| ",
               (actual - expected).abs().max().item<double>());
}

// The same full tensor on every rank (seeded); sizes divisible by any world size up to 4.
torch::Tensor full_tensor(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randint(-8, 8, shape, gen, torch::kFloat32);  // small integers: sums are exact
}

void scenario_collectives(const CommPtr& comm) {
  const int w = comm->size(), r = comm->rank();
  const torch::Tensor x = full_tensor({12, 4, 24}, 1);
  const torch::Tensor g = full_tensor({12, 4, 24}, 2);
  auto grad_of_rank = [&](int rank) { return g * (rank + 1); };  // each rank's upstream gradient
  torch::Tensor g_sum = torch::zeros_like(g);
  for (int i = 0; i < w; ++i) g_sum += grad_of_rank(i);

  for (int64_t dim : {0, 2, -2}) {
    const int64_t d = dim < 0 ? dim + 3 : dim;
    const std::string at_dim = c10::str(" along dim ", dim);
    // Shard -> Replicate; the backward sums the ranks' gradients and keeps this rank's piece.
    torch::Tensor local = x.chunk(w, d)[r].clone().requires_grad_(true);
    torch::Tensor full = lt::all_gather(local, dim, comm, lt::ReplicatedGrad::kPartial);
    expect_equal(full, x, "all_gather" + at_dim);
    (full * grad_of_rank(r)).sum().backward();
    expect_equal(local.grad(), g_sum.chunk(w, d)[r], "all_gather backward" + at_dim);
    // Identical consumers on every rank: each rank's gradient is whole; keep this rank's piece.
    torch::Tensor local2 = x.chunk(w, d)[r].clone().requires_grad_(true);
    (lt::all_gather(local2, dim, comm, lt::ReplicatedGrad::kIdentical) * g).sum().backward();
    expect_equal(local2.grad(), g.chunk(w, d)[r], "all_gather (identical consumers) backward" + at_dim);

    // Partial -> Shard; the backward gathers the pieces' gradients.
    torch::Tensor addend = (x * (r + 1)).requires_grad_(true);
    torch::Tensor piece = lt::reduce_scatter(addend, dim, comm);
    expect_equal(piece, (x * (w * (w + 1) / 2)).chunk(w, d)[r], "reduce_scatter" + at_dim);
    (piece * grad_of_rank(r).chunk(w, d)[r]).sum().backward();
    std::vector<torch::Tensor> pieces;
    for (int i = 0; i < w; ++i) pieces.push_back(grad_of_rank(i).chunk(w, d)[i]);
    expect_equal(addend.grad(), torch::cat(pieces, d), "reduce_scatter backward" + at_dim);

    // Replicate -> Shard; the backward gathers.
    torch::Tensor whole = x.clone().requires_grad_(true);
    torch::Tensor mine = lt::scatter(whole, dim, comm);
    expect_equal(mine, x.chunk(w, d)[r], "scatter" + at_dim);
    (mine * grad_of_rank(r).chunk(w, d)[r]).sum().backward();
    expect_equal(whole.grad(), torch::cat(pieces, d), "scatter backward" + at_dim);
  }

  // Partial -> Replicate: identity backward (every rank's consumer is the same).
  torch::Tensor addend = (x * (r + 1)).requires_grad_(true);
  torch::Tensor total = lt::all_reduce(addend, comm);
  expect_equal(total, x * (w * (w + 1) / 2), "all_reduce");
  expect_equal(addend, x * (r + 1), "all_reduce leaves its input alone");
  (total * g).sum().backward();
  expect_equal(addend.grad(), g, "all_reduce backward");

  // Replicate consumed differently per rank: the backward sums the ranks' gradients.
  torch::Tensor rep = x.clone().requires_grad_(true);
  torch::Tensor same = lt::all_reduce_in_backward(rep, comm);
  expect_equal(same, x, "all_reduce_in_backward forward");
  (same * grad_of_rank(r)).sum().backward();
  expect_equal(rep.grad(), g_sum, "all_reduce_in_backward backward");

  // Shard(0) -> Shard(2) and back: the gradient returns to Shard(0).
  torch::Tensor s0 = x.chunk(w, 0)[r].clone().requires_grad_(true);
  torch::Tensor s2 = lt::all_to_all(s0, 0, 2, comm);
  expect_equal(s2, x.chunk(w, 2)[r], "all_to_all Shard(0)->Shard(2)");
  (s2 * g.chunk(w, 2)[r]).sum().backward();
  expect_equal(s0.grad(), g.chunk(w, 0)[r], "all_to_all backward");

  // redistribute picks the op from the placements.
  expect_equal(lt::redistribute(x.chunk(w, 0)[r], lt::Shard{0}, lt::Replicate{}, comm), x,
               "redistribute Shard(0)->Replicate");
  expect_equal(lt::redistribute(x * (r + 1), lt::Partial{}, lt::Shard{2}, comm),
               (x * (w * (w + 1) / 2)).chunk(w, 2)[r], "redistribute Partial->Shard(2)");
  expect_equal(lt::redistribute(x, lt::Replicate{}, lt::Replicate{}, comm), x, "redistribute identity");
  bool refused = false;
  try {
    lt::redistribute(x, lt::Replicate{}, lt::Partial{}, comm);
  } catch (const loom::Error& e) {
    refused = std::string(e.what()).find("from Replicate to Partial(sum) is not supported") != std::string::npos;
  }
  LOOM_REQUIRE(refused, "redistribute Replicate->Partial should be refused by name");
}

}  // namespace

int main(int argc, char** argv) {
  return loom::testing::worker_main(argc, argv, {{"collectives", scenario_collectives}});
}
