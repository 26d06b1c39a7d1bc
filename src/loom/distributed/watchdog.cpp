#include "loom/distributed/watchdog.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "loom/core/error.h"
#include "loom/core/logging.h"

namespace loom::distributed {
namespace {

double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// The self-pipe of dump_flight_recorder_on_sigterm: the handler writes the signal number (write()
// is async-signal-safe), the dumping thread reads it.
int stop_signal_pipe[2] = {-1, -1};

void on_stop_signal(int sig) {
  const char byte = static_cast<char>(sig);
  const int saved_errno = errno;
  (void)!::write(stop_signal_pipe[1], &byte, 1);
  errno = saved_errno;
}

}  // namespace

std::chrono::milliseconds watchdog_poll_interval(std::chrono::milliseconds timeout) {
  return std::clamp<std::chrono::milliseconds>(timeout / 20, std::chrono::milliseconds(50),
                                               std::chrono::seconds(1));
}

std::chrono::milliseconds backend_timeout_for(std::chrono::milliseconds timeout) {
  return timeout + 2 * watchdog_poll_interval(timeout) + std::chrono::seconds(1);
}

std::string describe(const CollectiveStall& stall) {
  char age[64];
  std::snprintf(age, sizeof(age), "%.2f s, past the collective timeout of %.2f s",
                seconds(stall.age), seconds(stall.timeout));
  return c10::str("collective watchdog: ", describe(stall.record), " has been pending for ", age,
                  " (comm.timeout_seconds); exiting with code ", kExitCollectiveTimeout,
                  " so the launcher stops (and may restart) the job");
}

void report_stall_and_exit(const CollectiveStall& stall, FlightRecorder& recorder) {
  log::error(describe(stall));
  const std::string dump = recorder.dump();
  const int rank = log::rank();
  std::string text = c10::str("[rank", rank, "] flight recorder of rank ", rank,
                              " (last collectives, oldest first):\n");
  size_t begin = 0;
  while (begin < dump.size()) {
    const size_t end = dump.find('\n', begin);
    const size_t stop = end == std::string::npos ? dump.size() : end;
    text += c10::str("[rank", rank, "]   ", dump.substr(begin, stop - begin), "\n");
    begin = stop + 1;
  }
  if (recorder.dump_to_file(describe(stall))) {
    text += c10::str("[rank", rank, "] flight recorder written to ", recorder.dump_file().string(), "\n");
  }
  std::fputs(text.c_str(), stderr);
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(kExitCollectiveTimeout);
}

void dump_flight_recorder_on_sigterm() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (::pipe2(stop_signal_pipe, O_CLOEXEC) != 0) return;  // no dump, the signal acts as before
    std::thread([] {
      char sig = 0;
      while (::read(stop_signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
      }
      flight_recorder().dump_to_file(
          "stopped by signal SIGTERM (`loom launch` stops every rank when one fails: see the "
          "other ranks' records for the collective that stalled)");
      std::signal(sig, SIG_DFL);
      std::raise(sig);
    }).detach();
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(SIGTERM, &action, nullptr);
  });
}

CollectiveWatchdog::CollectiveWatchdog(std::chrono::milliseconds timeout, FlightRecorder& recorder,
                                       StallHandler on_stall)
    : recorder_(recorder), on_stall_(std::move(on_stall)), timeout_(timeout) {
  LOOM_REQUIRE_USAGE(timeout.count() > 0, "collective watchdog timeout must be positive (got ",
                     timeout.count(), " ms); set comm.timeout_seconds > 0");
  if (!on_stall_) {
    on_stall_ = [&recorder](const CollectiveStall& stall) { report_stall_and_exit(stall, recorder); };
  }
  thread_ = std::thread([this] { run(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::chrono::milliseconds CollectiveWatchdog::timeout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return timeout_;
}

void CollectiveWatchdog::set_timeout(std::chrono::milliseconds timeout) {
  LOOM_REQUIRE_USAGE(timeout.count() > 0, "collective watchdog timeout must be positive (got ",
                     timeout.count(), " ms); set comm.timeout_seconds > 0");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    timeout_ = timeout;
  }
  wake_.notify_all();  // a shorter timeout also means a shorter poll interval
}

std::optional<CollectiveStall> CollectiveWatchdog::check(
    std::chrono::steady_clock::time_point now) const {
  const std::chrono::milliseconds limit = timeout();
  std::optional<FlightRecord> oldest = recorder_.oldest_pending();
  if (!oldest) return std::nullopt;
  const auto age = now - oldest->started_steady;
  if (age <= limit) return std::nullopt;
  return CollectiveStall{std::move(*oldest), age, limit};
}

void CollectiveWatchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, watchdog_poll_interval(timeout_));
    if (stopping_) return;
    lock.unlock();
    std::optional<CollectiveStall> stall = check();
    if (stall) {
      on_stall_(*stall);
      return;  // one report per watchdog: the handler normally ends the process
    }
    lock.lock();
  }
}

}  // namespace loom::distributed
