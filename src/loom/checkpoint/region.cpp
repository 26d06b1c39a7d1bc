#include "loom/checkpoint/region.h"

#include <c10/util/StringUtil.h>

namespace loom::checkpoint {
namespace {

std::string list(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += c10::str(i ? ", " : "", v[i]);
  return s + "]";
}

int64_t product(const std::vector<int64_t>& v, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < v.size(); ++i) n *= v[i];
  return n;
}

}  // namespace

std::string region_error(const std::vector<int64_t>& shape, const Region& r) {
  int64_t limit = product(shape);
  if (!r.whole_tensor_box()) {
    if (r.box_offsets.size() != shape.size() || r.box_sizes.size() != shape.size()) {
      return c10::str("box ", list(r.box_offsets), "+", list(r.box_sizes), " does not have the ",
                      shape.size(), " dims of shape ", list(shape));
    }
    for (size_t d = 0; d < shape.size(); ++d) {
      if (r.box_offsets[d] < 0 || r.box_sizes[d] < 0 || r.box_offsets[d] + r.box_sizes[d] > shape[d]) {
        return c10::str("box ", list(r.box_offsets), "+", list(r.box_sizes), " lies outside shape ",
                        list(shape));
      }
    }
    limit = product(r.box_sizes);
  }
  if (r.begin < 0 || r.end < r.begin || r.end > limit) {
    return c10::str("elements [", r.begin, ", ", r.end, ") lie outside the ", limit, " elements of ",
                    r.whole_tensor_box() ? "the tensor" : "its box");
  }
  return "";
}

std::string describe(const Region& r) {
  const std::string range = c10::str("[", r.begin, ", ", r.end, ")");
  if (r.whole_tensor_box()) return range;
  return c10::str("box ", list(r.box_offsets), "+", list(r.box_sizes), " elements ", range);
}

std::vector<Run> runs_of(const std::vector<int64_t>& shape, const Region& r) {
  std::vector<Run> runs;
  if (r.end <= r.begin) return runs;
  if (r.whole_tensor_box() || shape.empty()) {
    runs.push_back({r.begin, 0, r.end - r.begin});
    return runs;
  }
  const size_t n = shape.size();
  std::vector<int64_t> stride(n, 1);
  for (size_t d = n - 1; d > 0; --d) stride[d - 1] = stride[d] * shape[d];
  const int64_t row = r.box_sizes[n - 1];
  if (row == 0) return runs;
  // Walk the box rows that [begin, end) touches, with an odometer over the leading box dims.
  const int64_t first_row = r.begin / row, last_row = (r.end - 1) / row;
  std::vector<int64_t> index(n - 1, 0);
  for (int64_t k = first_row, d = static_cast<int64_t>(n) - 2; d >= 0; --d) {
    index[static_cast<size_t>(d)] = k % r.box_sizes[static_cast<size_t>(d)];
    k /= r.box_sizes[static_cast<size_t>(d)];
  }
  for (int64_t k = first_row; k <= last_row; ++k) {
    int64_t global = r.box_offsets[n - 1];
    for (size_t d = 0; d + 1 < n; ++d) global += (r.box_offsets[d] + index[d]) * stride[d];
    const int64_t lo = std::max(r.begin, k * row), hi = std::min(r.end, (k + 1) * row);
    const Run run{global + (lo - k * row), lo - r.begin, hi - lo};
    if (!runs.empty() && runs.back().global + runs.back().length == run.global) {
      runs.back().length += run.length;  // rows that touch (the box spans the trailing dims)
    } else {
      runs.push_back(run);
    }
    for (int64_t d = static_cast<int64_t>(n) - 2; d >= 0; --d) {
      if (++index[static_cast<size_t>(d)] < r.box_sizes[static_cast<size_t>(d)]) break;
      index[static_cast<size_t>(d)] = 0;
    }
  }
  return runs;
}

}  // namespace loom::checkpoint
