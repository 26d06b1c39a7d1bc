#include "loom/train/memory_accounting.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <iomanip>
#include <sstream>
#include <unordered_set>

namespace loom::train {
namespace {
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
double gib(int64_t bytes) { return static_cast<double>(bytes) / kGiB; }
}  // namespace

std::string MemoryBreakdown::describe() const {
  std::ostringstream out;
  out << std::fixed << std::setprecision(3) << "parameters " << gib(parameters) << " GiB, gradients "
      << gib(gradients) << " GiB, optimizer state " << gib(optimizer_state) << " GiB, activations "
      << gib(activations) << " GiB, buffers in flight " << gib(buffers_in_flight) << " GiB, other "
      << gib(other) << " GiB = peak " << gib(peak) << " GiB";
  return out.str();
}

std::map<std::string, double> MemoryBreakdown::as_metrics() const {
  return {{"mem_params_gib", gib(parameters)},       {"mem_grads_gib", gib(gradients)},
          {"mem_optimizer_gib", gib(optimizer_state)}, {"mem_activations_gib", gib(activations)},
          {"mem_buffers_gib", gib(buffers_in_flight)}, {"mem_other_gib", gib(other)},
          {"mem_step_peak_gib", gib(peak)}};
}

StepMemoryAccounts::StepMemoryAccounts(c10::Device device) : tracker_(device) {}

void StepMemoryAccounts::begin_step() {
  tracker_.reset_gradient_bytes();  // zero_grad has set them to None (where they do not persist)
  tracker_.reset_peak();
  tensors_at_start_ = tracker_.current_bytes() - tracker_.comm_buffer_bytes();
}

MemoryBreakdown StepMemoryAccounts::end_step(const PersistentMemory& persistent) const {
  const memory::AllocationTracker::Peak peak = tracker_.peak();
  MemoryBreakdown b;
  b.parameters = persistent.parameters;
  b.gradients = persistent.gradients;
  b.optimizer_state = persistent.optimizer_state;
  b.buffers_in_flight = peak.comm_buffers;
  // Allocated in the step and alive at its peak (tensors only: the buffers are counted above).
  int64_t in_step = peak.tensors() - tensors_at_start_;
  // What was alive at the start: the persistent parts (gradients only where they persist; else
  // those the step had created by its peak are gradients, not activations).
  int64_t at_start = b.parameters + b.optimizer_state;
  if (persistent.gradients_persist) {
    at_start += b.gradients;
  } else {
    b.gradients = peak.gradients;
    in_step -= peak.gradients;
  }
  // The tracker starts after the process did (and a lazily created optimizer state appears in the
  // first step), so the remainders can dip below zero: they are clamped, and the peak is the sum
  // of what is reported.
  b.activations = std::max<int64_t>(0, in_step);
  b.other = std::max<int64_t>(0, tensors_at_start_ - at_start);
  b.peak = b.parameters + b.gradients + b.optimizer_state + b.activations + b.buffers_in_flight + b.other;
  return b;
}

int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const c10::StorageImpl*> seen;
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    if (seen.insert(storage).second) bytes += static_cast<int64_t>(storage->nbytes());
  }
  return bytes;
}

}  // namespace loom::train
