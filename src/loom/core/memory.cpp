#include "loom/core/memory.h"

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
}  // namespace loom::memory
