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
#include <memory>
#include <string>

#include "loom/dist/device_mesh.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/models/llama3/model.h"

namespace loom::llama3 {

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
std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Transformer& model, const dist::DeviceMesh& mesh,
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
void init_sharded_weights(Transformer& model, fsdp::FSDPModule& fsdp, uint64_t seed,
                          c10::Device device = c10::Device(c10::kCPU));

}  // namespace loom::llama3
