// Memory statistics: the process's current and peak resident set size from /proc (the peak can be
// reset with Linux clear_refs, so a trainer can report a per-step peak), and the same figures for
// a rank's accelerator from its caching allocator.
#pragma once
#include <c10/core/Device.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>

namespace loom::memory {

// Out-of-memory with context. Where Loom allocates something large whose size the user controls
// (a model built from a checkpoint's config, generate's key/value cache), the allocator's own
// failure (std::bad_alloc, c10::OutOfMemoryError, the CPU allocator's "can't allocate memory")
// says neither what was being allocated nor what to change. with_allocation_context runs `fn` and
// turns such a failure into a one-line loom::Error: "out of memory allocating <what>: <size> on
// <device> (<allocator's words>); <hint>". Any other exception passes through unchanged.
bool is_allocation_failure(const std::exception_ptr& error);
[[noreturn]] void rethrow_with_allocation_context(const std::exception_ptr& error, const std::string& what,
                                                  int64_t bytes, const c10::Device& device,
                                                  const std::string& hint);
template <typename Fn>
void with_allocation_context(Fn&& fn, const std::string& what, int64_t bytes, const c10::Device& device,
                             const std::string& hint) {
  try {
    fn();
  } catch (...) {
    rethrow_with_allocation_context(std::current_exception(), what, bytes, device, hint);
  }
}
// "1.5 GiB", "12.0 MiB", "512 bytes": sizes in messages.
std::string bytes_text(int64_t bytes);
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
//
// Communication buffers (FSDP's unsharded parameter and gradient buffers) are counted apart: they
// report through note_comm_buffer_bytes() and their allocator traffic is hidden from the hook
// (UntrackedAllocationScope), so a peak splits into "buffers in flight" and everything else.
// peak_bytes() is the peak of the sum.
class AllocationTracker {
 public:
  explicit AllocationTracker(c10::Device device = c10::Device(c10::kCPU));
  ~AllocationTracker();
  AllocationTracker(const AllocationTracker&) = delete;
  AllocationTracker& operator=(const AllocationTracker&) = delete;

  // Tensors plus communication buffers, now and at the peak.
  int64_t current_bytes() const;
  int64_t peak_bytes() const;
  // Communication buffers alive now.
  int64_t comm_buffer_bytes() const;
  // Gradients among the tensors, as note_gradient_bytes reports them (the allocator hook cannot
  // tell them from other tensors); the count restarts from zero here.
  void reset_gradient_bytes();
  // What was alive at the moment of the peak: the communication buffers, and the tensors, of which
  // `gradients` were noted as gradients.
  struct Peak {
    int64_t total = 0;
    int64_t comm_buffers = 0;
    int64_t gradients = 0;
    int64_t tensors() const { return total - comm_buffers; }
  };
  Peak peak() const;
  // Restarts the peak from the current figure.
  void reset_peak();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// A communication buffer of `delta` bytes was allocated (> 0) or released (< 0): every live
// tracker of its device type counts it as a buffer in flight.
void note_comm_buffer_bytes(const c10::Device& device, int64_t delta);

// A gradient of `bytes` was created (its tensor already counted by the allocator hook): every
// live tracker of its device type counts it among its gradients until reset_gradient_bytes.
// Called where a step's first gradient of a parameter appears, for layouts whose gradients are set
// to None between steps.
void note_gradient_bytes(const c10::Device& device, int64_t bytes);

// While alive, this thread's allocations and frees are not reported to its tracker: a buffer
// that reports itself through note_comm_buffer_bytes allocates in this scope, so it is not counted
// twice. On the CPU an allocation made here is never reported, nor is its free, on any thread;
// an accelerator's caching allocator reports every free, so such memory must be freed in this
// scope too. A no-op where no tracker is installed (e.g. while torch's profiler records).
class UntrackedAllocationScope {
 public:
  UntrackedAllocationScope();
  ~UntrackedAllocationScope();
  UntrackedAllocationScope(const UntrackedAllocationScope&) = delete;
  UntrackedAllocationScope& operator=(const UntrackedAllocationScope&) = delete;

 private:
  std::optional<c10::DebugInfoGuard> guard_;  // set only over a tracker
};

}  // namespace loom::memory
