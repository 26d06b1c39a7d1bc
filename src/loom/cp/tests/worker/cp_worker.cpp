// Per-rank scenarios of the context-parallel tests, started as
//   loom launch --nproc N --exec -- loom_cp_worker attention
// Every rank draws the same whole-sequence q, k, v (GQA: fewer key/value heads) and output
// gradient, computes causal attention over the whole sequence with libtorch (the reference), then
// its head-tail shard through ring_attention with each rotate method, and compares the output and
// the q, k, v gradients with the reference's shards. Exits 1 with one line naming the rank, case
// and mismatch.
#include <cmath>
#include <cstdio>
#include <limits>
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

// GPT-OSS's features through ring attention: a sliding window (smaller than, equal to and larger
// than a chunk, and spanning several), learned sinks, documents, against an explicit float64
// softmax over [masked scores, sink] of the whole sequence: output and the q, k, v and sinks
// gradients (the sinks' summed over the ranks, as data parallelism over cp sums them).
void check_features(const tensor::CommPtr& comm, cp::RotateMethod method, int64_t window, bool sinks, bool documents) {
  const int c = comm->size(), r = comm->rank();
  constexpr int64_t kBatch = 2, kSeq = 64, kDim = 16, kHeads = 4, kKvHeads = 2;
  const std::string name = c10::str("cp=", c, " ", options::enum_name(method), " window=", window,
                                    sinks ? " sinks" : "", documents ? " block_causal" : " causal");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const torch::Tensor q_full = torch::randn({kBatch, kHeads, kSeq, kDim}, gen, torch::kFloat64);
  const torch::Tensor k_full = torch::randn({kBatch, kKvHeads, kSeq, kDim}, gen, torch::kFloat64);
  const torch::Tensor v_full = torch::randn({kBatch, kKvHeads, kSeq, kDim}, gen, torch::kFloat64);
  const torch::Tensor s_full = torch::randn({kHeads}, gen, torch::kFloat64) * 2;
  const torch::Tensor dout_full = torch::randn({kBatch, kHeads, kSeq, kDim}, gen, torch::kFloat64);
  const torch::Tensor doc_ids = (torch::rand({kBatch, kSeq}, gen) < 1.0 / 12).to(torch::kInt64).cumsum(1);

  // The reference: explicit softmax in float64 under causal & window & documents, sink column.
  const torch::Tensor pos = torch::arange(kSeq, torch::kInt64);
  const torch::Tensor distance = pos.unsqueeze(1) - pos.unsqueeze(0);
  torch::Tensor allowed = (distance >= 0).unsqueeze(0);
  if (window > 0) allowed = allowed.logical_and((distance < window).unsqueeze(0));
  if (documents) allowed = allowed.logical_and(doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1));
  torch::Tensor q_ref = q_full.clone().requires_grad_(), k_ref = k_full.clone().requires_grad_(),
                v_ref = v_full.clone().requires_grad_(), s_ref = s_full.clone().requires_grad_();
  const int64_t groups = kHeads / kKvHeads;
  torch::Tensor scores = torch::matmul(q_ref, k_ref.repeat_interleave(groups, 1).transpose(-1, -2)) / std::sqrt(double(kDim));
  scores = scores.masked_fill(allowed.unsqueeze(1).logical_not(), -std::numeric_limits<double>::infinity());
  torch::Tensor probs;
  if (sinks) {
    const torch::Tensor column = s_ref.view({1, -1, 1, 1}).expand({kBatch, -1, kSeq, 1});
    probs = torch::cat({scores, column}, -1).softmax(-1).narrow(-1, 0, kSeq);
  } else {
    probs = scores.softmax(-1);
  }
  const torch::Tensor out_ref = torch::matmul(probs, v_ref.repeat_interleave(groups, 1));
  out_ref.backward(dout_full);

  auto shard = [&](const torch::Tensor& t) { return cp::shard_sequence(t, 2, r, c).to(torch::kFloat32); };
  torch::Tensor q = shard(q_full).requires_grad_(), k = shard(k_full).requires_grad_(),
                v = shard(v_full).requires_grad_();
  torch::Tensor s = sinks ? s_full.to(torch::kFloat32).requires_grad_() : torch::Tensor();
  const torch::Tensor out = cp::ring_attention(q, k, v, comm, method,
                                               documents ? cp::shard_sequence(doc_ids, 1, r, c) : torch::Tensor(), s,
                                               window);
  out.backward(shard(dout_full));
  const double d_out = max_relative_diff(out.to(torch::kFloat64), shard(out_ref).to(torch::kFloat64));
  const double d_q = max_relative_diff(q.grad().to(torch::kFloat64), shard(q_ref.grad()).to(torch::kFloat64));
  const double d_k = max_relative_diff(k.grad().to(torch::kFloat64), shard(k_ref.grad()).to(torch::kFloat64));
  const double d_v = max_relative_diff(v.grad().to(torch::kFloat64), shard(v_ref.grad()).to(torch::kFloat64));
  double d_s = 0;
  if (sinks) {
    torch::Tensor ds = s.grad().clone();
    comm->all_reduce(ds);
    d_s = max_relative_diff(ds.to(torch::kFloat64), s_ref.grad());
  }
  LOOM_REQUIRE(d_out <= 2e-5 && d_q <= 2e-5 && d_k <= 2e-5 && d_v <= 2e-5 && d_s <= 2e-5, name, " rank ", r,
               ": relative differences from the whole-sequence reference: out ", d_out, ", dq ", d_q, ", dk ", d_k,
               ", dv ", d_v, ", dsinks ", d_s);
  if (r == 0) {
    std::printf("%s: max relative difference out %.2e dq %.2e dk %.2e dv %.2e dsinks %.2e\n", name.c_str(), d_out,
                d_q, d_k, d_v, d_s);
  }
}

void scenario_features(const tensor::CommPtr& comm) {
  const int64_t n = 64 / (2 * comm->size());  // tokens per chunk
  for (auto method : {cp::RotateMethod::kRing, cp::RotateMethod::kAllGather}) {
    for (int64_t window : {int64_t{5}, n, n + 7, 3 * n + 1}) {
      check_features(comm, method, window, false, false);
      check_features(comm, method, window, true, false);
      check_features(comm, method, window, true, true);
    }
    check_features(comm, method, 0, true, false);
    check_features(comm, method, 0, true, true);
    check_features(comm, method, 9, false, true);
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
  return loom::testing::worker_main(argc, argv, {{"attention", scenario_attention}, {"features", scenario_features}});
}
