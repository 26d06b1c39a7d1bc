// Tensor parallelism of a decoder as data (TorchTitan's `sharding.py` tables): each rule names
// modules by dotted path, "*" matching one segment (a layer id), and the parallel style
// tp::TensorParallel applies to them. A family's plan is its table; applying it is shared.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/distributed/comm.h"
#include "loom/models/common/decoder.h"
#include "loom/models/spec.h"
#include "loom/tp/tensor_parallel.h"

namespace loom::models {

enum class TPStyle {
  kColwise,               // nn::Linear, weight Shard(0)
  kRowwise,               // nn::Linear, weight Shard(1)
  kRowwiseEmbedding,      // nn::Embedding, vocabulary rows sharded
  kSequenceParallel,      // nn::RMSNorm on this rank's tokens (SP), gradient summed
  kPrepareInput,          // any module: gather the sequence before it (SP)
  kColwiseOutput,         // the output head; with loss parallel its logits stay vocabulary-sharded
  kReplicatePartialGrad,  // any module whose replicated weights see this rank's heads (QK-norm)
  // Any module computing on its own tokens alone (an MoE layer, no expert TP): replicated weights
  // whose gradients are summed over the group under sequence parallelism (each rank routes other
  // tokens), and need nothing without it (every rank computes the same).
  kTokenwise,
  // A parameter (the pattern names it, not a module) holding one value per query head: Shard(0),
  // this rank's heads (attention sinks, beside the colwise wq).
  kHeadwise,
};

struct TPRule {
  std::string pattern;  // "tok_embeddings", "layers.*.attention.wq", ...
  TPStyle style;
  // kPrepareInput: the module's colwise children that read the gathered input (computed with the
  // gather under async TP), as paths relative to it.
  std::vector<std::string> consumers = {};
};
using TPPlan = std::vector<TPRule>;

// The plan of a decoder of TransformerBlocks (Megatron-LM / TorchTitan's Llama plan), which Llama 3
// and Qwen3 use as theirs:
//   tok_embeddings  rowwise embedding (vocab rows)     output: SP sequence-sharded, else reduced
//   per block       attention_norm, ffn_norm: sequence parallel (SP only)
//                   attention, feed_forward: prepare input (SP: gather the sequence)
//                   wq, wk, wv, w1, w3: colwise   wo, w2: rowwise
//                   q_norm, k_norm (QK-norm): replicated, each rank normalizing its own heads, so
//                   their gradients are summed over the group
//                   attention.sinks (GPT-OSS): headwise, Shard(0) like wq's heads; biases of
//                   wq, wk, wv shard with their outputs, wo's stays replicated (added once after
//                   the reduction)
//   norm            sequence parallel
//   output          colwise; with loss parallel the model's loss becomes
//                   tp::vocab_parallel_cross_entropy, else the logits are gathered (a tied head is
//                   the embedding's vocabulary shard, read by loss parallel)
// Each rank keeps n_heads/t query and n_kv_heads/t key/value heads.
const TPPlan& transformer_tp_plan();

// The first rule whose pattern matches `fqn`; nullptr when none.
const TPRule* match_tp_rule(const TPPlan& plan, const std::string& fqn);

// Applies `plan` to every module of `model` it matches, in the model's module order, recording
// into `tp` (the stages of one pipeline rank share one TensorParallel); parts a stage lacks are
// simply not there to match. With loss parallel the model's loss becomes
// tp::vocab_parallel_cross_entropy on the vocabulary-sharded head weight (tied or not).
void apply_tp(Decoder& model, tp::TensorParallel& tp, const TPPlan& plan, const TensorParallelOptions& options);
std::shared_ptr<tp::TensorParallel> apply_tp(Decoder& model, tensor::CommPtr comm, const TPPlan& plan,
                                             const TensorParallelOptions& options);

// Initializes the TP-sharded model exactly as init_weights(seed) initializes the whole one.
void init_tp_weights(Decoder& model, const tp::TensorParallel& tp, uint64_t seed);

// Checks that `degree` splits the model as the plan needs: query heads, key/value heads, the FFN
// hidden size and the vocabulary (the head is always vocabulary-sharded), with sequence
// parallelism the sequence length, and that a tied head runs with loss parallel. A
// loom::UsageError (exit 2) naming the value and the degrees that would work. Called before any
// process group exists.
void validate_tp_degree(const DecoderArgs& args, int64_t degree, int64_t seq_len, const TensorParallelOptions& options);

// What the TransformerBlock plan sends over the tensor-parallel group for one micro-batch
// (forward and backward) of `batch` x `seq` tokens in `element_bytes`-byte activations, plus the
// once-per-step gradient sum of the SP norms (and QK-norms); per collective: calls, payload bytes
// and ring-model wire bytes (the formula of docs/tensor_parallel.md, which the TP tests compare
// with the measured counters exactly). `chunk_tokens` is loss parallel's chunk.
std::map<distributed::CommOp, distributed::CommCounter> tp_comm_volume(const DecoderArgs& args, int64_t batch,
                                                                       int64_t seq, int degree,
                                                                       const TensorParallelOptions& options,
                                                                       int64_t element_bytes = 4,
                                                                       int64_t chunk_tokens = 256);

}  // namespace loom::models
