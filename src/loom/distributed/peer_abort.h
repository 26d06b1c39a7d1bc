// Ending a job promptly when one rank fails. A rank that throws reports its error
// (loom::report_error) and leaves; without more, its peers would sit in their next collective until
// comm.timeout_seconds, or in the shutdown barrier, and the job would hang silently.
//
// So every Distributed world of more than one rank has a PeerAbort:
//   - on this rank's error report it writes "loom/abort" = "rank R: <error line>" into the
//     rendezvous store unless another rank did first (then this rank's report becomes
//     "stopping: rank R: ..." with kExitPeerFailed: its own error was the echo of R's, e.g. a
//     collective broken by R leaving); rank 0, which hosts the store, then lingers for two poll
//     intervals so the others can read the key before the store goes away;
//   - a background thread polls the store for that key through its own client connection (the
//     main thread's may be blocked inside a collective) and, when another rank wrote it, logs
//       [rank0] error: stopping: rank 1 failed: token id 9000 ... 
//     and ends this process with kExitPeerFailed (4) without running destructors: the main thread
//     may be blocked inside the backend, exactly as for the collective watchdog.
// Under `loom launch` the launcher also stops the other ranks when one exits; the store key makes
// the same happen under torchrun, srun or mpirun, and says why.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "loom/distributed/launch_env.h"

namespace loom::distributed {

inline constexpr const char* kAbortKey = "loom/abort";

class PeerAbort {
 public:
  // `store` is this rank's rendezvous store (used to write the key); the polling thread uses its
  // own client connection (store->clone()).
  PeerAbort(const LaunchEnv& env, c10::intrusive_ptr<c10d::Store> store,
            std::chrono::milliseconds poll_interval = std::chrono::milliseconds(200));
  ~PeerAbort();  // stop()
  PeerAbort(const PeerAbort&) = delete;
  PeerAbort& operator=(const PeerAbort&) = delete;

  // Tells the other ranks that this one failed (idempotent). Returns the line of the rank that
  // failed first: `error_line` itself, or an earlier one another rank wrote (this rank's error is
  // then most likely the echo of that one: a collective broken by the peer leaving). Called from
  // the error-report hook.
  std::string abort(const std::string& error_line);
  // How long a rank that wrote the key should stay up so the others can read it (rank 0 only: it
  // hosts the store).
  std::chrono::milliseconds linger() const;
  // Stops polling (before a normal shutdown: rank 0's store may go away right after the barrier).
  void stop();

 private:
  void run();

  LaunchEnv env_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds poll_interval_;
  std::atomic<bool> aborted_by_self_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  int hook_id_ = -1;
  std::thread thread_;
};

}  // namespace loom::distributed
