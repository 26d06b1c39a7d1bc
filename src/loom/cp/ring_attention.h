// Context parallelism's attention: each of the c ranks of the "cp" mesh dim holds 2 of the 2c
// equal chunks of every sequence, chunks i and 2c-1-i ("head-tail" load balance: under a causal
// mask the early chunk attends to few keys and the late one to many, so every rank does the same
// work). Its queries must attend to the keys and values of every rank:
//
//   ring       the key/value chunks travel around the ring (async p2p, the next pair's transfer
//              overlapped with this pair's attention), as in Ring Attention / TorchTitan's default;
//   allgather  one all-gather of every rank's keys and values, then the same blocks locally
//              (Megatron-LM's and Llama 3's choice: less latency, c x the key/value memory).
//
// Per (query chunk x, key chunk m): m < x attends fully, m == x causally, m > x not at all, so no
// mask is built (without documents or a sliding window) and no masked block is computed. A sliding
// window skips the blocks it cannot reach and masks, by global position, those it cuts. The blocks' partial results are merged exactly
// with their log-sum-exps (out = sum_k exp(lse_k - lse) out_k), in the same order for both
// methods, so ring and allgather give identical outputs (their key/value gradients are summed in
// a different order: around the ring, or by the reduce-scatter). Backward recomputes each block's
// gradients from the merged output and log-sum-exp (flash attention's backward takes them), and
// the key/value gradients go back to their owners: around the ring with the keys and values, or
// by one reduce-scatter. GQA: only the key/value heads travel.
//
// Layout: q [B, Hq, T, D], k and v [B, Hkv, T, D] with T = 2n local tokens (this rank's two
// chunks, early one first), Hq a multiple of Hkv. Kernels: libtorch's flash attention with
// log-sum-exp (CPU); other devices are refused with one line until they are built and run there.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "loom/core/options.h"
#include "loom/tensor/collectives.h"

namespace loom::cp {

enum class RotateMethod { kRing, kAllGather };
// parallelism.context_parallel_rotate_method: "allgather" | "ring" (core/options.h's enum protocol).
const options::EnumNames<RotateMethod>& option_names(RotateMethod);

// `document_ids` ([B, T] int64, this rank's tokens; undefined = plain causal): block-causal
// attention, where a token attends only to earlier tokens of its own document. Each block then
// carries the mask of its (query, key) document pairs; blocks with no allowed pair are skipped,
// and query rows of a block with none get log-sum-exp -inf so they weigh nothing in the merge.
//
// `sinks` ([Hq], undefined = none; differentiable): GPT-OSS's attention sinks, one logit per query
// head added once to each row's softmax denominator, after the blocks are merged (out *= exp(lse -
// lse'), lse' = logaddexp(lse, sink)); the blocks' backward runs on that output and lse'. The
// sinks' gradient is this rank's query rows' share. `sliding_window` > 0 (tokens; 0 = none): a
// query at global position i sees keys i - window < j <= i; blocks wholly outside the window are
// skipped (not computed, forward or backward; the keys and values still travel whole), blocks it
// cuts are masked by the tokens' global positions (chunk_ids), with the documents' mask when both
// apply.
torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const tensor::CommPtr& comm, RotateMethod method,
                             const torch::Tensor& document_ids = torch::Tensor(),
                             const torch::Tensor& sinks = torch::Tensor(), int64_t sliding_window = 0);

// Head-tail sharding of a sequence dim: the 2c chunk indices rank `rank` of `degree` holds.
std::vector<int64_t> chunk_ids(int rank, int degree);
// This rank's tokens of `full` along `dim` (length divisible by 2 x degree): chunks i and 2c-1-i.
torch::Tensor shard_sequence(const torch::Tensor& full, int64_t dim, int rank, int degree);
// The positions (0-based, in the whole sequence) of this rank's tokens: what RoPE needs.
torch::Tensor sequence_positions(int64_t seq_len, int rank, int degree);

}  // namespace loom::cp
