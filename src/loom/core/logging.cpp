#include "loom/core/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include <unistd.h>

namespace loom::log {
namespace {
std::atomic<int> g_rank{0};
std::atomic<int> g_level{static_cast<int>(Level::kInfo)};
std::mutex g_mutex;
bool g_status_shown = false;  // a status line without a newline is on stdout (guarded by g_mutex)
// Back to the start of the line and erase it (VT100: every terminal emulator in use has it).
constexpr const char* kEraseLine = "\r\033[K";
bool all_ranks() {
  static const bool v = [] {
    const char* e = std::getenv("LOOM_LOG_ALL_RANKS");
    return e != nullptr && std::string(e) == "1";
  }();
  return v;
}
}  // namespace

void set_rank(int r) { g_rank = r; }
int rank() { return g_rank; }
void set_level(Level level) { g_level = static_cast<int>(level); }

void write(Level level, const std::string& message) {
  if (static_cast<int>(level) < g_level.load()) return;
  const int r = g_rank.load();
  if (r != 0 && level < Level::kWarn && !all_ranks()) return;
  static const char* names[] = {"debug", "info", "warning", "error"};
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_status_shown) {
    std::fputs(kEraseLine, stdout);
    std::fflush(stdout);
    g_status_shown = false;
  }
  FILE* out = level >= Level::kWarn ? stderr : stdout;
  if (level == Level::kInfo) {
    std::fprintf(out, "[rank%d] %s\n", r, message.c_str());
  } else {
    std::fprintf(out, "[rank%d] %s: %s\n", r, names[static_cast<int>(level)], message.c_str());
  }
  std::fflush(out);
}

bool stdout_is_terminal() {
  static const bool v = ::isatty(STDOUT_FILENO) == 1;
  return v;
}

bool status(const std::string& line) {
  if (g_rank.load() != 0 || !stdout_is_terminal()) return false;
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stdout, "%s[rank%d] %s", kEraseLine, g_rank.load(), line.c_str());
  std::fflush(stdout);
  g_status_shown = true;
  return true;
}

}  // namespace loom::log
