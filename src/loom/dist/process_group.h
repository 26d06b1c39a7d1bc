// Process-group setup: rendezvous through a c10d::TCPStore hosted by rank 0, the world group, and
// sub-groups over subsets of ranks. CPU runs use Gloo; NCCL exists only in builds with
// USE_C10D_NCCL. World size 1 needs no store and no network: every group is a local Comm.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/dist/comm.h"
#include "loom/dist/launch_env.h"

namespace gloo::transport {
class Device;
}

namespace loom::dist {

class CollectiveWatchdog;
class PeerAbort;

enum class BackendKind { kGloo, kNccl };

inline constexpr std::chrono::milliseconds kDefaultDistTimeout = std::chrono::minutes(10);

// `timeout` bounds every collective: a world of more than one rank runs a CollectiveWatchdog
// (watchdog.h) that ends this process with kExitCollectiveTimeout when a collective stays pending
// longer; the backend's own per-operation timeout is backend_timeout_for(timeout), slightly later.
class Distributed {
 public:
  Distributed(LaunchEnv env, std::chrono::milliseconds timeout, BackendKind backend,
              c10::intrusive_ptr<c10d::Store> store);
  ~Distributed();
  Distributed(const Distributed&) = delete;
  Distributed& operator=(const Distributed&) = delete;

  const LaunchEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  std::chrono::milliseconds timeout() const;
  // Changes the collective timeout: the watchdog's at once, the backends' for operations issued
  // from now on (existing groups included).
  void set_timeout(std::chrono::milliseconds timeout);
  // Null when the world has one rank (nothing can stall).
  CollectiveWatchdog* watchdog() const { return watchdog_.get(); }
  BackendKind backend_kind() const { return backend_kind_; }
  const std::shared_ptr<Comm>& world() const { return world_; }
  // The rendezvous store; null when the world has one rank.
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // A Comm named `name` over `ranks` (world ranks in group-rank order, distinct, containing this
  // rank). The backend for a given rank list is created once, rendezvousing under a store prefix
  // derived from the list, and shared by every Comm over the same ranks (a flattened mesh dim that
  // equals a real one reuses its connections). Only member ranks call this, and they must create
  // groups in the same relative order (construction blocks until all members arrive).
  std::shared_ptr<Comm> new_group(const std::vector<int>& ranks, const std::string& name);

  // Starts the peer-failure monitor (peer_abort.h): this rank's error report tells the others to
  // stop, and another rank's makes this one stop. init_distributed turns it on for every world of
  // more than one rank.
  void enable_peer_abort();

  // Waits for every rank at a world barrier, then drops this context's cache of group backends
  // (each closes when the last Comm using it is gone). Call once before a normal exit so rank 0's
  // store outlives the other ranks' last use of it. Never call it while unwinding from an error:
  // the peers may never arrive (report the error instead, see core/error_report.h).
  void shutdown();

 private:
  c10::intrusive_ptr<c10d::Backend> make_backend(const std::vector<int>& ranks, int group_rank);

  LaunchEnv env_;
  std::chrono::milliseconds timeout_;
  BackendKind backend_kind_;
  c10::intrusive_ptr<c10d::Store> store_;
  // One Gloo transport device (one I/O loop) serves every group of this process.
  std::shared_ptr<gloo::transport::Device> gloo_device_;
  std::shared_ptr<Comm> world_;
  mutable std::mutex mutex_;  // guards timeout_ and backends_
  std::map<std::vector<int>, c10::intrusive_ptr<c10d::Backend>> backends_;
  std::unique_ptr<PeerAbort> peer_abort_;
  std::unique_ptr<CollectiveWatchdog> watchdog_;  // last: stops before anything else goes
};

// Rendezvous and world-group creation; starts the collective watchdog when the world has more than
// one rank. Also sets loom::log's rank and the intra-op thread count (see intra_op_threads).
// Throws loom::Error naming the rendezvous address when it times out.
std::shared_ptr<Distributed> init_distributed(const LaunchEnv& env,
                                              std::chrono::milliseconds timeout = kDefaultDistTimeout,
                                              BackendKind backend = BackendKind::kGloo);

// Intra-op threads for one rank: LOOM_NUM_THREADS, else OMP_NUM_THREADS, else the CPUs this
// process may run on divided by the ranks on this node (at least 1), so ranks do not oversubscribe.
int intra_op_threads(const LaunchEnv& env);

}  // namespace loom::dist
