// Where a rank's memory goes in a training step: the step's peak split into parameters, gradients,
// optimizer state, activations, communication buffers in flight and the rest, as Megatron-LM's
// and TorchTitan's memory reports name them. Printed once after the first step and written with
// every logged step's metrics (metrics.jsonl, TensorBoard).
//
// How each part is measured (exact byte counts, not estimates):
//   parameters, gradients, optimizer state  the bytes of the tensors the rank keeps between steps
//                          (FSDP: its shards), each storage counted once; gradients set to None
//                          between steps count as far as the backward had created them by the peak;
//   buffers in flight      FSDP's unsharded parameter and gradient buffers alive at the peak
//                          (they report themselves to memory::AllocationTracker);
//   activations            everything else the step had allocated at its peak on top of what was
//                          alive when it began: the tensors saved for backward and the kernels'
//                          temporaries. Where gradients are set to None between steps (no FSDP or
//                          DDP), those the backward had created by the peak are taken out of it
//                          (noted by ParallelizedModel's gradient hooks and the pipeline stages)
//                          and reported as the gradients;
//   other                  what was alive at the step's start besides the three persistent parts
//                          (the batch, DDP's buckets, caches).
// The parts sum to `peak`: the peak of what c10's allocator and the buffers held, which is what
// an allocator-level figure can attribute (RSS also counts the runtime and malloc's caches).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/core/memory.h"

namespace loom::train {

struct MemoryBreakdown {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  int64_t activations = 0;
  int64_t buffers_in_flight = 0;
  int64_t other = 0;
  int64_t peak = 0;  // the sum of the above

  // "parameters 0.12 GiB, gradients ..., = peak 1.00 GiB"
  std::string describe() const;
  // {"mem_params_gib": .., "mem_grads_gib": .., "mem_optimizer_gib": .., "mem_activations_gib": ..,
  //  "mem_buffers_gib": .., "mem_other_gib": .., "mem_step_peak_gib": ..}
  std::map<std::string, double> as_metrics() const;
};

// What a rank keeps between steps (see the header comment).
struct PersistentMemory {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  // Whether the gradients stay allocated between steps (FSDP's shards, DDP's buckets) or are
  // allocated again in each step's backward.
  bool gradients_persist = false;
};

// Watches this thread's allocations (and those of the threads that inherit its state, autograd's
// among them) from construction on. Not while torch's profiler records: both use c10's one
// per-thread memory-reporting slot.
class StepMemoryAccounts {
 public:
  explicit StepMemoryAccounts(c10::Device device);

  void begin_step();
  // The step's breakdown; `persistent` as measured now.
  MemoryBreakdown end_step(const PersistentMemory& persistent) const;

 private:
  memory::AllocationTracker tracker_;
  int64_t tensors_at_start_ = 0;
};

// The bytes of the distinct storages of `tensors` (views into one flat buffer count it once).
int64_t storage_bytes(const std::vector<at::Tensor>& tensors);

}  // namespace loom::train
