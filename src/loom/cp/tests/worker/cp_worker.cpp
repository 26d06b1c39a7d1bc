// Per-rank scenarios of the context-parallel tests, started as
//   loom launch --nproc N --exec -- loom_cp_worker attention
// Every rank draws the same whole-sequence q, k, v (GQA: fewer key/value heads) and output
// gradient, computes causal attention over the whole sequence with libtorch (the reference), then
// its head-tail shard through ring_attention with each rotate method, and compares the output and
// the q, k, v gradients with the reference's shards. Exits 1 with one line naming the rank, case
// and mismatch.
#include <cstdio>
#include <string>

#include "loom/core/error.h"
#include "loom/cp/ring_attention.h"
#include "loom/testing/worker.h"

namespace {

using namespace loom;

double max_relative_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a - b).abs().max().item<double>() / scale;
}

void check_case(const tensor::CommPtr& comm, int64_t heads, int64_t kv_heads, cp::RotateMethod method,
                bool documents) {
  const int c = comm->size(), r = comm->rank();
  const std::string name = c10::str("cp=", c, " heads=", heads, "/", kv_heads, " ", options::enum_name(method),
                                    documents ? " block_causal" : " causal");
  constexpr int64_t kBatch = 2, kSeq = 64, kDim = 16;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const torch::Tensor q_full = torch::randn({kBatch, heads, kSeq, kDim}, gen);
  const torch::Tensor k_full = torch::randn({kBatch, kv_heads, kSeq, kDim}, gen);
  const torch::Tensor v_full = torch::randn({kBatch, kv_heads, kSeq, kDim}, gen);
  const torch::Tensor dout_full = torch::randn({kBatch, heads, kSeq, kDim}, gen);
  // Documents: each row cut at random places (about one boundary per 12 tokens), so blocks with
  // no allowed pair, rows of a block with none, and documents spanning ranks all occur.
  const torch::Tensor doc_ids = (torch::rand({kBatch, kSeq}, gen) < 1.0 / 12).to(torch::kInt64).cumsum(1);
  std::optional<torch::Tensor> ref_mask;
  if (documents) {
    ref_mask = (doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1))
                   .logical_and(torch::ones({kSeq, kSeq}, torch::kBool).tril())
                   .unsqueeze(1);
  }

  torch::Tensor q_ref = q_full.clone().requires_grad_(), k_ref = k_full.clone().requires_grad_(),
                v_ref = v_full.clone().requires_grad_();
  const torch::Tensor out_ref = at::scaled_dot_product_attention(q_ref, k_ref, v_ref, ref_mask, 0.0, !documents,
                                                                 std::nullopt, heads != kv_heads);
  out_ref.backward(dout_full);

  auto shard = [&](const torch::Tensor& t) { return cp::shard_sequence(t, 2, r, c); };
  torch::Tensor q = shard(q_full).requires_grad_(), k = shard(k_full).requires_grad_(),
                v = shard(v_full).requires_grad_();
  const torch::Tensor out = cp::ring_attention(q, k, v, comm, method,
                                               documents ? cp::shard_sequence(doc_ids, 1, r, c) : torch::Tensor());
  out.backward(shard(dout_full));
  const double d_out = max_relative_diff(out, shard(out_ref));
  const double d_q = max_relative_diff(q.grad(), shard(q_ref.grad()));
  const double d_k = max_relative_diff(k.grad(), shard(k_ref.grad()));
  const double d_v = max_relative_diff(v.grad(), shard(v_ref.grad()));
  LOOM_REQUIRE(d_out <= 1e-5 && d_q <= 1e-5 && d_k <= 1e-5 && d_v <= 1e-5, name, " rank ", r,
               ": relative differences from whole-sequence attention: out ", d_out, ", dq ", d_q, ", dk ", d_k,
               ", dv ", d_v);
  if (r == 0) {
    std::printf("%s: max relative difference out %.2e dq %.2e dk %.2e dv %.2e\n", name.c_str(), d_out, d_q, d_k,
                d_v);
  }
}

void scenario_attention(const tensor::CommPtr& comm) {
  for (auto method : {cp::RotateMethod::kRing, cp::RotateMethod::kAllGather}) {
    for (bool documents : {false, true}) {
      check_case(comm, 4, 4, method, documents);
      check_case(comm, 8, 2, method, documents);  // GQA: only the 2 key/value heads travel
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return loom::testing::worker_main(argc, argv, {{"attention", scenario_attention}});
}
