// Memory statistics: the process's current and peak resident set size from /proc (the peak can be
// reset with Linux clear_refs, so a trainer can report a per-step peak), and the same figures for
// a rank's accelerator from its caching allocator.
#pragma once
#include <c10/core/Device.h>

#include <cstdint>

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
}  // namespace loom::memory
