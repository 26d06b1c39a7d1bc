#include "loom/data/byte_level.h"

#include <algorithm>
#include <array>

namespace loom::data {

namespace unicode {
namespace {

enum UnicodeClass : uint8_t {
  kOther = 0,
  kLetter = 1,
  kMark = 2,
  kDecimalNumber = 3,
  kLetterNumber = 4,
  kOtherNumber = 5,
  kConnectorPunctuation = 6,
};

struct ClassRange {
  char32_t first;
  char32_t last;
  uint8_t cls;
};

constexpr ClassRange kClassRanges[] = {
#include "loom/data/unicode_tables.inc"
};

// The Basic Multilingual Plane is looked up in a 64 KiB table built once; the rest of the code
// space by binary search over the ranges.
const std::array<uint8_t, 0x10000>& bmp_table() {
  static const auto table = [] {
    std::array<uint8_t, 0x10000> t{};
    for (const ClassRange& r : kClassRanges) {
      if (r.first > 0xFFFF) break;
      for (char32_t c = r.first; c <= std::min<char32_t>(r.last, 0xFFFF); ++c) t[c] = r.cls;
    }
    return t;
  }();
  return table;
}

uint8_t class_of(char32_t c) {
  if (c < 0x10000) return bmp_table()[c];
  if (c > 0x10FFFF) return kOther;
  const auto* end = std::end(kClassRanges);
  const auto* it = std::upper_bound(std::begin(kClassRanges), end, c,
                                    [](char32_t v, const ClassRange& r) { return v < r.first; });
  if (it == std::begin(kClassRanges)) return kOther;
  --it;
  return c <= it->last ? it->cls : static_cast<uint8_t>(kOther);
}

}  // namespace

char32_t decode_utf8(std::string_view text, size_t pos, size_t* length) {
  const auto b0 = static_cast<unsigned char>(text[pos]);
  *length = 1;
  if (b0 < 0x80) return b0;
  size_t n;
  char32_t cp;
  char32_t min;
  if ((b0 & 0xE0) == 0xC0) {
    n = 2, cp = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 3, cp = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return kInvalid;
  }
  if (pos + n > text.size()) return kInvalid;
  for (size_t i = 1; i < n; ++i) {
    const auto b = static_cast<unsigned char>(text[pos + i]);
    if ((b & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (b & 0x3F);
  }
  // Overlong encodings, surrogates and values past U+10FFFF are not valid UTF-8.
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return kInvalid;
  *length = n;
  return cp;
}

void append_utf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

bool is_letter(char32_t c) { return class_of(c) == kLetter; }

bool is_number(char32_t c) {
  const uint8_t k = class_of(c);
  return k == kDecimalNumber || k == kLetterNumber || k == kOtherNumber;
}

bool is_whitespace(char32_t c) {
  switch (c) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0:
    case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool is_word(char32_t c) {
  const uint8_t k = class_of(c);
  return k == kLetter || k == kMark || k == kDecimalNumber || k == kLetterNumber ||
         k == kConnectorPunctuation || c == 0x200C || c == 0x200D;
}

}  // namespace unicode

namespace byte_level {
namespace {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
// (controls, space, DEL, NBSP, soft hyphen) are shifted to U+0100.. in byte order.
struct Alphabet {
  std::array<char32_t, 256> byte_to_char{};
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 324> char_to_byte{};  // every mapped character is below U+0144

  Alphabet() {
    char_to_byte.fill(-1);
    int shifted = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + shifted++);
      byte_to_char[b] = c;
      unicode::append_utf8(c, byte_to_utf8[b]);
      char_to_byte[c] = static_cast<int16_t>(b);
    }
  }
};

const Alphabet& alphabet() {
  static const Alphabet a;
  return a;
}

// Character classes the two patterns distinguish.
enum CharClass : uint8_t { kL, kN, kS, kO };

struct DecodedText {
  std::vector<char32_t> cp;
  std::vector<uint8_t> cls;
  std::vector<uint32_t> offset;  // byte offset of each character, plus one past the end
};

void decode_text(std::string_view text, DecodedText& d) {
  d.cp.clear();
  d.cls.clear();
  d.offset.clear();
  size_t pos = 0;
  while (pos < text.size()) {
    size_t len;
    const char32_t c = unicode::decode_utf8(text, pos, &len);
    d.cp.push_back(c);
    d.offset.push_back(static_cast<uint32_t>(pos));
    uint8_t k;
    if (c < 0x80) {
      const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
      k = alpha ? kL : (c >= '0' && c <= '9') ? kN : unicode::is_whitespace(c) ? kS : kO;
    } else if (c == unicode::kInvalid) {
      k = kO;
    } else {
      k = unicode::is_letter(c) ? kL : unicode::is_number(c) ? kN
          : unicode::is_whitespace(c) ? kS : kO;
    }
    d.cls.push_back(k);
    pos += len;
  }
  d.offset.push_back(static_cast<uint32_t>(text.size()));
}

size_t run_end(const std::vector<uint8_t>& cls, size_t i, uint8_t k) {
  while (i < cls.size() && cls[i] == k) ++i;
  return i;
}

bool is_cr_or_lf(char32_t c) { return c == '\r' || c == '\n'; }

// `\s+(?!\S)|\s+` at a whitespace character: the whitespace run, less its last character when a
// non-space follows and the run is longer than one (that character then prefixes the next word).
size_t match_whitespace(const DecodedText& d, size_t i) {
  const size_t j = run_end(d.cls, i, kS);
  if (j == d.cls.size() || j - 1 == i) return j;
  return j - 1;
}

// 's|'t|'re|'ve|'m|'ll|'d, optionally case-insensitive (Llama 3). Returns the end or 0.
size_t match_contraction(const DecodedText& d, size_t i, bool ignore_case) {
  const size_t n = d.cp.size();
  if (d.cp[i] != '\'' || i + 1 >= n) return 0;
  auto lower = [&](char32_t c) -> char32_t {
    if (!ignore_case) return c;
    if (c >= 'A' && c <= 'Z') return c - 'A' + 'a';
    if (c == 0x017F) return 's';  // LATIN SMALL LETTER LONG S case-folds to 's'
    return c;
  };
  const char32_t c1 = lower(d.cp[i + 1]);
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
  if (i + 2 < n) {
    const char32_t c2 = lower(d.cp[i + 2]);
    if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return i + 3;
  }
  return 0;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
size_t match_gpt2(const DecodedText& d, size_t i) {
  const size_t n = d.cp.size();
  if (size_t e = match_contraction(d, i, false)) return e;
  const uint8_t k = d.cls[i];
  if (d.cp[i] == ' ' && i + 1 < n && d.cls[i + 1] != kS) return run_end(d.cls, i + 1, d.cls[i + 1]);
  if (k != kS) return run_end(d.cls, i, k);
  return match_whitespace(d, i);
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
// \s*[\r\n]+|\s+(?!\S)|\s+
size_t match_llama3(const DecodedText& d, size_t i) {
  const size_t n = d.cp.size();
  if (size_t e = match_contraction(d, i, true)) return e;
  const uint8_t k = d.cls[i];
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (k == kL) return run_end(d.cls, i, kL);
  if (k != kN && !is_cr_or_lf(d.cp[i]) && i + 1 < n && d.cls[i + 1] == kL) {
    return run_end(d.cls, i + 1, kL);
  }
  // \p{N}{1,3}
  if (k == kN) return std::min(run_end(d.cls, i, kN), i + 3);
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  size_t other_start = n;
  if (k == kO) {
    other_start = i;
  } else if (d.cp[i] == ' ' && i + 1 < n && d.cls[i + 1] == kO) {
    other_start = i + 1;
  }
  if (other_start < n) {
    size_t j = run_end(d.cls, other_start, kO);
    while (j < n && is_cr_or_lf(d.cp[j])) ++j;
    return j;
  }
  // k is whitespace here. `\s*[\r\n]+`: the greedy \s* gives back characters until one line break
  // can follow, so the match ends just after the last \r or \n of the whitespace run.
  const size_t ws_end = run_end(d.cls, i, kS);
  for (size_t p = ws_end; p > i; --p) {
    if (is_cr_or_lf(d.cp[p - 1])) return p;
  }
  return match_whitespace(d, i);
}

}  // namespace

std::string to_alphabet(std::string_view bytes) {
  const Alphabet& a = alphabet();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += a.byte_to_utf8[b];
  return out;
}

std::optional<std::string> from_alphabet(std::string_view text) {
  const Alphabet& a = alphabet();
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    size_t len;
    const char32_t c = unicode::decode_utf8(text, pos, &len);
    if (c >= a.char_to_byte.size() || a.char_to_byte[c] < 0) return std::nullopt;
    out += static_cast<char>(a.char_to_byte[c]);
    pos += len;
  }
  return out;
}

std::optional<SplitPattern> pattern_from_regex(std::string_view regex) {
  if (regex == kGpt2Pattern) return SplitPattern::kGpt2;
  if (regex == kLlama3Pattern) return SplitPattern::kLlama3;
  return std::nullopt;
}

const char* pattern_name(SplitPattern pattern) {
  return pattern == SplitPattern::kGpt2 ? "GPT-2" : "Llama 3";
}

void split(std::string_view text, SplitPattern pattern, std::vector<std::string_view>& out) {
  thread_local DecodedText d;
  decode_text(text, d);
  const size_t n = d.cp.size();
  size_t i = 0;
  while (i < n) {
    const size_t e = pattern == SplitPattern::kGpt2 ? match_gpt2(d, i) : match_llama3(d, i);
    out.push_back(text.substr(d.offset[i], d.offset[e] - d.offset[i]));
    i = e;
  }
}

}  // namespace byte_level
}  // namespace loom::data
