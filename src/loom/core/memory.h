// Memory statistics: the process's current and peak resident set size from /proc (the peak can be
// reset with Linux clear_refs, so a trainer can report a per-step peak), and the same figures for
// a rank's accelerator from its caching allocator.
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

namespace loom::memory {
int64_t current_rss_bytes();
int64_t peak_rss_bytes();
// Resets the kernel's high-water mark to the current RSS; returns false where unsupported.
bool reset_peak_rss();

// The memory a training step is charged with on `device`: on the CPU the process's peak RSS; on an
// accelerator (CUDA) its caching allocator's peak of allocated bytes, through c10's device-generic
// allocator interface (so no CUDA header is needed to build this).
int64_t peak_bytes(const c10::Device& device);
// Bytes the accelerator's caching allocator holds from the driver (0 on the CPU).
int64_t reserved_bytes(const c10::Device& device);
void reset_peak(const c10::Device& device);

// Counts the bytes that c10's allocators hand out for `device` while it is alive: the tensors this
// thread (and the threads that inherit its thread-local state, autograd's among them) allocates
// and frees. What a forward leaves allocated for its backward (the saved activations) is
// current_bytes() after it, and the peak of a step is peak_bytes(): exact figures where peak RSS
// is blurred by the process's other memory and by malloc's caching. Uses c10's memory-profiling
// hook (the one torch.profiler(profile_memory=True) uses), so only one tracker (or profiler) per
// thread at a time; allocations made before it started are not counted, nor are their frees.
class AllocationTracker {
 public:
  explicit AllocationTracker(c10::Device device = c10::Device(c10::kCPU));
  ~AllocationTracker();
  AllocationTracker(const AllocationTracker&) = delete;
  AllocationTracker& operator=(const AllocationTracker&) = delete;

  int64_t current_bytes() const;
  int64_t peak_bytes() const;
  // Restarts the peak from the current figure.
  void reset_peak();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace loom::memory
