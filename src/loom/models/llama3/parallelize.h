// Parallelizing the Llama 3 model, as TorchTitan's models/llama3/infra/parallelize.py: FSDP (and
// HSDP) over the data-parallel mesh dims, one group per TransformerBlock plus the root (token
// embedding, final norm, output head).
//
// Trainer flow:
//   auto fsdp = llama3::apply_fsdp(model, mesh, policy);        // model may be on the meta device
//   llama3::init_sharded_weights(model, *fsdp, seed);          // same values as init_weights()
//   fsdp::ShardedAdamW optimizer(fsdp, adamw_options, weight_decay);
//   per step: optimizer.zero_grad();
//             for each micro-batch: fsdp->set_requires_gradient_sync(last);  // or always true
//                                   model.forward(...) -> loss -> backward
//             fsdp->clip_grad_norm_(max_norm);  optimizer.step();
//   gather:   fsdp->full_state_dict()  (or fsdp->unshard() ... fsdp->reshard())
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "loom/ac/activation_checkpoint.h"
#include "loom/distributed/device_mesh.h"
#include "loom/float8/convert.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/models/llama3/model.h"
#include "loom/models/spec.h"
#include "loom/parallel/parallelized_model.h"
#include "loom/cp/ring_attention.h"
#include "loom/tp/tensor_parallel.h"

namespace loom::llama3 {

// ---- Tensor parallelism (TorchTitan's apply_tp for Llama 3) ------------------------------------

// The options of the plan are models::TensorParallelOptions (sequence parallel, loss parallel,
// async TP), as the run asks for them.
using models::TensorParallelOptions;

// Checks that `degree` splits the model as TP needs: query heads, key/value heads, the FFN hidden
// size and the vocabulary (the output head is always vocabulary-sharded), and, with sequence
// parallelism, the sequence length. loom::UsageError (exit 2) naming the value and the nearest
// degrees that would work. Called before any process group exists.
void validate_tp_degree(const ModelArgs& args, int64_t degree, int64_t seq_len, const TensorParallelOptions& options);

// The Megatron-LM / TorchTitan plan, on the model in place (any device, meta included):
//   tok_embeddings  rowwise embedding (vocab rows)     output: SP sequence-sharded, else reduced
//   per block       attention_norm, ffn_norm: sequence parallel (SP only)
//                   attention, feed_forward: prepare input (SP: gather the sequence)
//                   wq, wk, wv, w1, w3: colwise   wo, w2: rowwise
//   norm            sequence parallel
//   output          colwise; with loss parallel the model's loss becomes
//                   tp::vocab_parallel_cross_entropy, else the logits are gathered
// Each rank keeps n_heads/t query and n_kv_heads/t key/value heads. Returns the applied plan (the
// parameters' layouts; the gradients to sum over the group after backward).
std::shared_ptr<tp::TensorParallel> apply_tp(Transformer& model, tensor::CommPtr comm,
                                             const TensorParallelOptions& options);
// The same plan recorded into an existing `tp` (the stages of one pipeline rank share one plan);
// parts a pipeline stage lacks (embedding, norm + head) are skipped.
void apply_tp(Transformer& model, tp::TensorParallel& tp, const TensorParallelOptions& options);

// Initializes the TP-sharded model exactly as init_weights(seed) initializes the whole one.
void init_tp_weights(Transformer& model, const tp::TensorParallel& tp, uint64_t seed);

// ---- The whole plan (TorchTitan's parallelize_llama) --------------------------------------------

// The plan as llama3 resolves it from models::ParallelizeOptions (the run's settings).
struct PlanOptions {
  // Float8 linears (convert_to_float8), applied before everything else; nullopt = off.
  std::optional<float8::Float8Options> float8;
  TensorParallelOptions tp;               // when the mesh has "tp"
  cp::RotateMethod cp_rotate_method = cp::RotateMethod::kAllGather;  // when the mesh has "cp"
  ac::ACOptions ac;                       // activation checkpointing of the blocks (apply_ac)
  fsdp::FSDPPolicy fsdp;                  // when FSDP is on (dp_shard or cp > 1; HSDP with dp_replicate)
  bool fsdp_reshard_last_block = false;   // see FSDPReshardSetting
  // Autocast around the forward (mixed precision without FSDP); nullopt = full precision.
  std::optional<c10::ScalarType> autocast_dtype;
  uint64_t seed = 0;                      // initialization (the single-process values, any layout)
  c10::Device device = c10::kCPU;         // where parameters and buffers live
};

// Context parallelism: every attention's core becomes ring attention over `comm` (the "cp" mesh
// dim); the model then takes this rank's head-tail chunks with their positions (prepare_batch).
void apply_cp(Transformer& model, tensor::CommPtr comm, cp::RotateMethod method);

// Activation checkpointing (TorchTitan's apply_ac): every TransformerBlock that `options` wraps
// (by layer id, so a pipeline stage, which keeps the whole model's ids, wraps the same blocks as
// the whole model) is checkpointed through its around-hook (ac::checkpoint_module). Applied after
// TP and CP, whose hooks inside the block are then re-run by the recompute, and before FSDP, whose
// hooks on the block sit outside it and run once per forward. Returns the number of blocks wrapped.
int64_t apply_ac(Transformer& model, const ac::ACOptions& options);

// The one composition, applied to the model parts this rank holds (the whole model, or its
// pipeline stages), in TorchTitan's order: the Float8 conversion of the linears (float8 set; the
// model converters run first), tensor parallelism (tp > 1; one plan for every part), context
// parallelism (cp > 1), activation checkpointing (activation_checkpoint.mode), then FSDP over
// dp_shard (dp_shard x cp with context parallelism; HSDP with dp_replicate; one part only), else
// materialization on the device; every parameter initialized from the seed, each rank only its
// pieces. The parts are built on the meta device. Returns the parts' ParallelParts without the
// step's driver: the caller adds the forward (parallelize) or the pipeline (pipeline_llama), and
// the replicas' gradient average (DDP in backward, or the pipeline's after the schedule).
parallel::ParallelParts compose(const std::vector<std::shared_ptr<Transformer>>& models,
                                const distributed::ParallelDims& dims, const distributed::DeviceMesh& mesh,
                                const PlanOptions& options);

// compose() on the whole model, its forward_loss under autocast (options.autocast_dtype) as the
// step's forward, and DDP over dp_replicate without sharding. The result is what the Trainer
// drives.
std::unique_ptr<parallel::ParallelizedModel> parallelize(std::shared_ptr<Transformer> model,
                                                         const distributed::ParallelDims& dims,
                                                         const distributed::DeviceMesh& mesh,
                                                         const PlanOptions& options);

// What the plan sends over the tensor-parallel group for one micro-batch (forward and backward)
// of `batch` x `seq` tokens in `element_bytes`-byte activations, plus the once-per-step gradient
// sum of the SP norms; per collective: calls, payload bytes and ring-model wire bytes (the formula
// of docs/tensor_parallel.md, which the TP tests compare with the measured counters exactly).
// `chunk_tokens` is loss parallel's chunk.
std::map<distributed::CommOp, distributed::CommCounter> tp_comm_volume(const ModelArgs& args, int64_t batch, int64_t seq,
                                                         int degree, const TensorParallelOptions& options,
                                                         int64_t element_bytes = 4, int64_t chunk_tokens = 256);

// parallelism.fsdp_reshard_after_forward as TorchTitan reads it: "default" reshards every block
// but the last (backward needs it first, so re-gathering it would only cost an all-gather),
// "always" every block, "never" none, an integer N keeps a 1/N shard (hpZ) for every block.
struct FSDPReshardSetting {
  fsdp::ReshardAfterForward blocks = fsdp::ReshardAfterForward::always();
  bool last_block = false;  // whether the last block follows `blocks` (else it is kept unsharded)

  static FSDPReshardSetting parse(const std::string& text);
};

// fully_shard on every TransformerBlock ("layers.<id>"), then on the model (the root: token
// embedding, final norm, output). The policy's reshard_after_forward applies to every block;
// with reshard_last_block = false the last block keeps its parameters (TorchTitan's default).
// Returns the root FSDP handle: finalize_backward, zero_grad, clip_grad_norm_, unshard/reshard,
// full_state_dict, and the parameter groups for fsdp::ShardedAdamW.
std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Transformer& model, const distributed::DeviceMesh& mesh,
                                             const fsdp::FSDPPolicy& policy,
                                             bool reshard_last_block = true);
// Same with the FSDP groups already built (tests, or a caller that made the FSDPMesh itself).
std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Transformer& model, const fsdp::FSDPMesh& mesh,
                                             const fsdp::FSDPPolicy& policy,
                                             bool reshard_last_block = true);

// Initializes the sharded parameters exactly as Transformer::init_weights(seed) would the whole
// model (each parameter drawn in full on the CPU on its own, this rank keeping its piece, so every
// device gets the same values), and materializes the model's non-persistent buffers (RoPE cache)
// on `device`, the rank's device (FSDPPolicy::device), if they are still on the meta device.
// With `tp`, FSDP shards TP-local pieces: each is cut from its parameter's whole value.
void init_sharded_weights(Transformer& model, fsdp::FSDPModule& fsdp, uint64_t seed,
                          c10::Device device = c10::Device(c10::kCPU),
                          const tp::TensorParallel* tp = nullptr);

}  // namespace loom::llama3
