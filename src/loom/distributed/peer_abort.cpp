#include "loom/distributed/peer_abort.h"

#include <cstdio>
#include <cstdlib>

#include "loom/core/error.h"
#include "loom/core/error_report.h"
#include "loom/core/logging.h"
#include "loom/distributed/comm.h"

namespace loom::distributed {

PeerAbort::PeerAbort(const LaunchEnv& env, c10::intrusive_ptr<c10d::Store> store,
                     std::chrono::milliseconds poll_interval)
    : env_(env), store_(std::move(store)), poll_interval_(poll_interval) {
  hook_id_ = add_abort_hook([this](ErrorReport& report) {
    const std::string mine = c10::str("rank ", env_.rank, ": ", report.message);
    const std::string first = abort(mine);
    if (first != mine && !first.empty()) {
      report.message = c10::str("stopping: ", first);
      report.exit_code = kExitPeerFailed;
    } else {
      report.linger_ms = static_cast<int>(linger().count());
    }
  });
  thread_ = std::thread([this] { run(); });
}

PeerAbort::~PeerAbort() {
  stop();
  remove_abort_hook(hook_id_);
}

void PeerAbort::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::string PeerAbort::abort(const std::string& error_line) {
  if (aborted_by_self_.exchange(true)) return error_line;
  std::string first = error_line;
  try {
    // compareSet with an empty expected value only creates the key: the first rank to fail is the
    // one everybody names; later ones get its line back.
    const std::vector<uint8_t> value(error_line.begin(), error_line.end());
    const std::vector<uint8_t> current = store_->compareSet(kAbortKey, {}, value);
    if (!current.empty()) first.assign(current.begin(), current.end());
  } catch (const std::exception&) {
    return error_line;  // the store is gone (rank 0 exited): the launcher or the watchdog stops the rest
  }
  return first;
}

std::chrono::milliseconds PeerAbort::linger() const {
  return env_.rank == 0 ? 2 * poll_interval_ + std::chrono::milliseconds(100)
                        : std::chrono::milliseconds(0);
}

void PeerAbort::run() {
  c10::intrusive_ptr<c10d::Store> client;
  try {
    client = store_->clone();  // its own connection: the main thread's may be inside a wait
  } catch (const std::exception& e) {
    log::warn("peer-failure monitor cannot reach the rendezvous store (", e.what(),
              "); a failed peer will be noticed by the launcher or the collective watchdog instead");
    return;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, poll_interval_);
    if (stopping_) return;
    lock.unlock();
    std::string failure;
    try {
      if (client->check({kAbortKey})) {
        const std::vector<uint8_t> v = client->get(kAbortKey);
        failure.assign(v.begin(), v.end());
      }
    } catch (const std::exception&) {
      return;  // store gone: either a normal end racing us, or rank 0 died (the launcher sees it)
    }
    if (!failure.empty() && !aborted_by_self_.load()) {
      log::error("stopping: ", failure);
      flight_recorder().dump_to_file(c10::str("stopping: ", failure));
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(kExitPeerFailed);
    }
    lock.lock();
  }
}

}  // namespace loom::distributed
