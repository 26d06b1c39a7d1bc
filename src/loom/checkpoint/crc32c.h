// CRC-32C (Castagnoli polynomial 0x1EDC6F41, reflected; the checksum of iSCSI, ext4 and cloud object
// stores). Checkpoints record one per chunk so a flipped or truncated byte is caught on load.
// Uses the SSE4.2 crc32 instruction when the CPU has it (about 8 bytes per 3 cycles), else a table.
#pragma once
#include <cstddef>
#include <cstdint>

namespace loom::checkpoint {

// CRC-32C of `data` continuing from `crc`, the checksum of the bytes before it (0 to start):
// crc32c(ab) == crc32c_extend(crc32c_extend(0, a), b).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size);
inline uint32_t crc32c(const void* data, size_t size) { return crc32c_extend(0, data, size); }
// Copies `size` bytes from `src` to `dst` (not overlapping) and returns crc32c_extend(crc, src,
// size): one pass over the memory instead of a copy followed by a checksum pass (checkpoint
// staging reads every byte of the training state once).
uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t size);

}  // namespace loom::checkpoint
