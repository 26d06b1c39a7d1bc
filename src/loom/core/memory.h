// Process memory statistics from /proc: current and peak resident set size. The peak can be reset
// (Linux clear_refs) so a trainer can report a per-step peak.
#pragma once
#include <cstdint>

namespace loom::memory {
int64_t current_rss_bytes();
int64_t peak_rss_bytes();
// Resets the kernel's high-water mark to the current RSS; returns false where unsupported.
bool reset_peak_rss();
}  // namespace loom::memory
