// Collective watchdog: a background thread that turns a hung collective into a prompt, attributable
// process exit, so that `loom launch` sees a failure (and can restart the job) instead of a job that
// hangs until someone notices.
//
// Every `poll_interval` it asks the flight recorder for the collectives still in flight. When the
// oldest has been pending longer than `timeout`, the default handler logs one error line naming it
//   [rank0] error: collective watchdog: all_reduce world[0,1] gseq=3 in=[4] out=[4] Float 16B has
//   been pending for 2.04 s, past the collective timeout of 2.00 s (comm.timeout_seconds);
//   exiting with code 124 so the launcher stops (and may restart) the job
// followed by this rank's flight-recorder dump (its last collectives, oldest first), and exits the
// process with kExitCollectiveTimeout. It exits rather than throws: the stalled thread is blocked
// inside the backend and cannot be unwound, and every peer of a stalled group is stuck as well.
//
// init_distributed starts one for every world of more than one rank, with its timeout (the
// trainer's comm.timeout_seconds). The backend's own per-operation timeout is set a little later
// (backend_timeout_for), so a stall is reported here, with the dump, rather than as a bare
// transport error; the backend timeout remains the backstop when no watchdog runs.
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "loom/core/error.h"
#include "loom/distributed/comm.h"

namespace loom::distributed {

// Exit code of a rank whose collective outlived the timeout: core/error.h's kExitWatchdog (124,
// what coreutils `timeout` uses), distinct from 1 (an error) and 2 (bad usage). `loom launch` names it.
inline constexpr int kExitCollectiveTimeout = kExitWatchdog;

// How often a watchdog with this timeout polls: timeout/20, within [50 ms, 1 s].
std::chrono::milliseconds watchdog_poll_interval(std::chrono::milliseconds timeout);
// The per-operation timeout to give the backend when the watchdog uses `timeout`: later by two poll
// intervals plus one second, so the watchdog fires first.
std::chrono::milliseconds backend_timeout_for(std::chrono::milliseconds timeout);

struct CollectiveStall {
  FlightRecord record;                   // the oldest collective still in flight
  std::chrono::steady_clock::duration age;  // how long it has been in flight
  std::chrono::milliseconds timeout;
};

// The error line for a stall (without the dump).
std::string describe(const CollectiveStall& stall);

// Logs describe(stall), then `recorder`'s dump, to stderr, writes the dump as JSON to the
// recorder's dump file when it has one (FlightRecorder::dump_to_file), and exits with kExitCollectiveTimeout
// without running destructors (the main thread is blocked inside the backend).
[[noreturn]] void report_stall_and_exit(const CollectiveStall& stall, FlightRecorder& recorder);

// From now on a SIGTERM first writes the flight recorder's dump file (FlightRecorder::dump_to_file,
// reason "stopped by signal SIGTERM ..."), on a thread of its own (a signal handler may not lock or
// allocate), then ends the process by the signal as the default action would. Under `loom launch`
// this is how a rank that is not itself stuck in a collective (computing, or hung elsewhere) leaves
// its record when the launcher stops it after a peer's watchdog fired. Idempotent.
void dump_flight_recorder_on_sigterm();

class CollectiveWatchdog {
 public:
  using StallHandler = std::function<void(const CollectiveStall&)>;

  // Starts the thread. `on_stall` runs on it, at most once; the default reports and exits.
  // Throws loom::UsageError when `timeout` is not positive.
  CollectiveWatchdog(std::chrono::milliseconds timeout, FlightRecorder& recorder = flight_recorder(),
                     StallHandler on_stall = {});
  ~CollectiveWatchdog();  // stops and joins the thread
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  std::chrono::milliseconds timeout() const;
  // Takes effect at the next poll; also for collectives already in flight.
  void set_timeout(std::chrono::milliseconds timeout);

  // One scan: the oldest pending collective when it is older than the timeout at `now`.
  std::optional<CollectiveStall> check(
      std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) const;

 private:
  void run();

  FlightRecorder& recorder_;
  StallHandler on_stall_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::chrono::milliseconds timeout_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace loom::distributed
