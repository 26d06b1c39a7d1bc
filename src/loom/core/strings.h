// Small string utilities shared by folders that suggest the nearest valid name in their errors
// (config keys and values, pipeline schedule names).
#pragma once
#include <cstddef>
#include <string_view>

namespace loom {

// Levenshtein distance: insertions, deletions and substitutions, each costing 1.
size_t edit_distance(std::string_view a, std::string_view b);

}  // namespace loom
