#include "loom/checkpoint/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#include <nmmintrin.h>
#endif

namespace loom::checkpoint {
namespace {

constexpr uint32_t kReflectedPolynomial = 0x82F63B78u;

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kReflectedPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

uint32_t extend_portable(uint32_t crc, const uint8_t* p, size_t n) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) c = kTable[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return ~c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t extend_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = ~crc & 0xFFFFFFFFu;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return ~static_cast<uint32_t>(c);
}

// The copy rides along with the checksum: the word is already in a register. When the
// destination is 8-byte aligned it is written with non-temporal stores: a checkpoint copy is
// written once and read back only by the device, so it should neither evict the training's cache
// lines nor read the destination lines in first.
__attribute__((target("sse4.2"))) uint32_t copy_sse42(uint32_t crc, uint8_t* dst,
                                                      const uint8_t* src, size_t n) {
  uint64_t c = ~crc & 0xFFFFFFFFu;
  while (n > 0 && (reinterpret_cast<uintptr_t>(src) & 7u) != 0) {
    *dst = *src;
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *src++);
    ++dst;
    --n;
  }
  if ((reinterpret_cast<uintptr_t>(dst) & 7u) == 0) {
    while (n >= 8) {
      uint64_t word;
      std::memcpy(&word, src, 8);
      _mm_stream_si64(reinterpret_cast<long long*>(dst), static_cast<long long>(word));
      c = _mm_crc32_u64(c, word);
      src += 8;
      dst += 8;
      n -= 8;
    }
    _mm_sfence();  // the streamed stores are visible before anyone is told the copy is done
  }
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, src, 8);
    std::memcpy(dst, &word, 8);
    c = _mm_crc32_u64(c, word);
    src += 8;
    dst += 8;
    n -= 8;
  }
  while (n > 0) {
    *dst = *src;
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *src++);
    ++dst;
    --n;
  }
  return ~static_cast<uint32_t>(c);
}

bool have_sse42() {
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return have;
}
#endif

}  // namespace

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (have_sse42()) return extend_sse42(crc, p, size);
#endif
  return extend_portable(crc, p, size);
}

uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t size) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
#if defined(__x86_64__)
  if (have_sse42()) return copy_sse42(crc, d, s, size);
#endif
  std::memcpy(d, s, size);
  return extend_portable(crc, s, size);
}

}  // namespace loom::checkpoint
