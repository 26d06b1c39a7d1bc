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

// strerror(errno) of the call that just failed, for "cannot open X: <why>" messages.
std::string errno_text();

}  // namespace loom
