#include "loom/core/error_report.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/strings.h"

namespace loom {
namespace {

std::mutex g_mutex;
std::map<int, std::function<void(ErrorReport&)>> g_hooks;
int g_next_id = 0;
std::atomic<bool> g_reported{false};
std::atomic<bool> g_stdout_line_open{false};

// The longest error line printed (and written to LOOM_ERROR_FILE, which the launcher quotes):
// enough for any message Loom composes, while a message quoting huge input (a 10 MB JSONL record,
// a long command-line value) stays a line, not megabytes on every rank and again in the launcher.
constexpr size_t kMaxErrorBytes = 2000;

// Keeps the report one line: a multi-line message (a c10 error with context) is joined, and
// capped at kMaxErrorBytes.
std::string one_line(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  for (char& c : s) {
    if (c == '\n') c = ' ';
  }
  return excerpt(s, kMaxErrorBytes);
}

// This process's rank: from the launcher's environment, since an error may come before the dist
// layer has told the logger (a configuration error is found before rendezvous).
int launched_rank() {
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  return log::rank();
}

}  // namespace

bool several_ranks_launched() {
  // torchrun / loom launch, mpirun, srun (distributed/launch_env.h reads the same variables).
  for (const char* name : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"}) {
    const char* v = std::getenv(name);
    if (v != nullptr) return std::atoi(v) > 1;
  }
  return false;
}

void report_current_exception_and_exit() {
  const ErrorReport report = report_error(describe_exception(std::current_exception()));
  if (several_ranks_launched()) {
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(report.exit_code);
  }
  throw ReportedError(report.exit_code);
}

void set_stdout_line_open(bool open) { g_stdout_line_open = open; }

ErrorReport describe_exception(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return {one_line(e.what()), e.exit_code()};
  } catch (const c10::Error& e) {
    return {one_line(e.what_without_backtrace()), kExitFailure};
  } catch (const std::exception& e) {
    return {one_line(e.what()), kExitFailure};
  } catch (...) {
    return {"unknown error (a non-standard exception)", kExitFailure};
  }
}

ErrorReport report_error(ErrorReport report) {
  if (g_reported.exchange(true)) return report;
  const int own_code = report.exit_code;  // before a hook rewrites it (to 4: a peer failed first)
  std::map<int, std::function<void(ErrorReport&)>> hooks;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    hooks = g_hooks;
  }
  for (auto it = hooks.rbegin(); it != hooks.rend(); ++it) {
    try {
      it->second(report);
    } catch (...) {
      // A hook that fails (e.g. the store is already gone) must not hide the report.
    }
  }
  report.message = one_line(std::move(report.message));  // also what a hook rewrote
  const std::string line = several_ranks_launched()
                               ? c10::str("[rank", launched_rank(), "] error: ", report.message)
                               : c10::str("error: ", report.message);
  bool launcher_quotes = false;
  if (const char* path = std::getenv("LOOM_ERROR_FILE"); path != nullptr && *path != '\0') {
    if (FILE* f = std::fopen(path, "w")) {
      std::fprintf(f, "%d\n%s\n", report.exit_code, line.c_str());
      launcher_quotes = std::fclose(f) == 0;
    }
  }
  // A configuration or usage error is the same on every rank (same command line, same files), and
  // `loom launch`, which set LOOM_ERROR_FILE, prints it once quoting that file: printing it here
  // too would make one line per rank plus the launcher's. Without the launcher (torchrun, srun, a
  // single process) nobody else prints it, so the rank does.
  if (!(launcher_quotes && own_code == kExitUsage)) {
    // A partial line of output (generate streaming text) ends first, so the error starts a line.
    if (g_stdout_line_open.exchange(false)) std::fputc('\n', stdout);
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
  if (report.linger_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(report.linger_ms));
  return report;
}

int add_abort_hook(std::function<void(ErrorReport&)> hook) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const int id = g_next_id++;
  g_hooks.emplace(id, std::move(hook));
  return id;
}

void remove_abort_hook(int id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_hooks.erase(id);
}

}  // namespace loom
