#include "loom/core/memory.h"

#include <c10/core/CachingDeviceAllocator.h>

#include <fstream>
#include <string>

namespace loom::memory {
namespace {
int64_t read_status_kib(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      return std::stoll(line.substr(key.size() + 1));
    }
  }
  return 0;
}
}  // namespace

int64_t current_rss_bytes() { return read_status_kib("VmRSS") * 1024; }
int64_t peak_rss_bytes() { return read_status_kib("VmHWM") * 1024; }
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  return static_cast<bool>(f);
}
namespace {
c10::CachingDeviceAllocator::DeviceStats accelerator_stats(const c10::Device& device) {
  return c10::getDeviceAllocator(device.type())->getDeviceStats(device.index() < 0 ? 0 : device.index());
}
constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
}  // namespace

int64_t peak_bytes(const c10::Device& device) {
  if (device.is_cpu()) return peak_rss_bytes();
  return accelerator_stats(device).allocated_bytes[kAggregate].peak;
}

int64_t reserved_bytes(const c10::Device& device) {
  if (device.is_cpu()) return 0;
  return accelerator_stats(device).reserved_bytes[kAggregate].current;
}

void reset_peak(const c10::Device& device) {
  if (device.is_cpu()) {
    reset_peak_rss();
    return;
  }
  c10::getDeviceAllocator(device.type())->resetPeakStats(device.index() < 0 ? 0 : device.index());
}

}  // namespace loom::memory
