// Small string utilities shared by folders: the nearest valid name in errors (config keys and
// values, pipeline schedule names), shapes and errno in messages.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

// Levenshtein distance: insertions, deletions and substitutions, each costing 1.
size_t edit_distance(std::string_view a, std::string_view b);

// "[4, 256]": a tensor shape as error messages print it.
std::string shape_text(const std::vector<int64_t>& shape);

// `text` as it is when it has at most `max_bytes` bytes, else its first `max_bytes` (cut at a UTF-8
// character boundary) followed by "… (N bytes)": how an error quotes input of any size (a 10 MB
// JSONL record must not become a 10 MB error line on every rank).
std::string excerpt(std::string_view text, size_t max_bytes = 80);

// strerror(errno) of the call that just failed, for "cannot open X: <why>" messages.
std::string errno_text();

}  // namespace loom
