// Process-group setup: rendezvous through a c10d::TCPStore hosted by rank 0, the world group, and
// sub-groups over subsets of ranks. Every group has a Gloo backend for CPU tensors; when the rank
// computes on a CUDA device (one device per rank, chosen once by the trainer and passed in here),
// every group also gets an NCCL backend bound to that device for the tensors that live there (see
// Comm). NCCL exists only in builds with USE_C10D_NCCL (a CUDA torch). World size 1 needs no store
// and no network: every group is a local Comm.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/distributed/comm.h"
#include "loom/distributed/config.h"
#include "loom/distributed/launch_env.h"

namespace gloo::transport {
class Device;
}

namespace loom::distributed {

class CollectiveWatchdog;
class PeerAbort;

enum class BackendKind { kGloo, kNccl };
const char* to_string(BackendKind kind);

// The backend that serves tensors on `device`: Gloo for the CPU, NCCL for CUDA. loom::UsageError
// for NCCL in a build without it, and for device types Loom has no backend for.
BackendKind backend_kind_for(c10::Device device);

// An NCCL backend over `store` (a prefix store private to the group), bound to `device` (the
// rank's CUDA device), with its communicator created now rather than at the first collective, so
// a failure names the group being created. Every member must call it at the same time.
// loom::UsageError in builds without NCCL.
c10::intrusive_ptr<c10d::Backend> new_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int group_rank, int group_size,
                                                   std::chrono::milliseconds timeout,
                                                   c10::Device device,
                                                   const std::vector<int>& world_ranks = {});

inline constexpr std::chrono::milliseconds kDefaultDistTimeout = std::chrono::minutes(10);

// `timeout` bounds every collective: a world of more than one rank runs a CollectiveWatchdog
// (watchdog.h) that ends this process with kExitCollectiveTimeout when a collective stays pending
// longer; the backend's own per-operation timeout is backend_timeout_for(timeout), slightly later.
// (NCCL collectives count as completed in the flight recorder once enqueued on their stream, so
// a stalled NCCL collective is caught by NCCL's own watchdog at the backend timeout instead.)
// `device`: this rank's compute device; groups get a device backend for it unless it is the CPU.
class Distributed {
 public:
  // `shared_memory`: groups of ranks that share a host (a single-node world) move the all-gathers,
  // reduce-scatters and all-reduces of CPU tensors through shared memory (shm_collectives.h).
  // `transport` kHost: no NCCL; collectives on device() tensors are staged through host memory
  // and the CPU transport (comm.device_transport, config.h), so ranks may share a GPU.
  Distributed(LaunchEnv env, std::chrono::milliseconds timeout, c10::Device device,
              c10::intrusive_ptr<c10d::Store> store, bool shared_memory = true,
              DeviceTransport transport = DeviceTransport::kNccl);
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
  const c10::Device& device() const { return device_; }
  // The backend of device() tensors: kGloo on the CPU (then the host backend serves them too).
  BackendKind device_backend_kind() const { return device_backend_kind_; }
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

  // Leaves this world without a barrier (elastic training re-forms on a new membership; some
  // peers are gone): stops the watchdog and the peer-failure monitor, marks the collectives still
  // in flight abandoned (flight_recorder().abandon_pending()), ends the shared-memory groups, and
  // keeps the Gloo backends alive for the rest of the process: a backend thread may stay blocked
  // on a dead peer until the backend's timeout, and destroying the backend would join it. Call
  // it after collectives were interrupted (comm.h), before dropping the world.
  void abandon();

 private:
  // A group's backends: Gloo for CPU tensors; NCCL for device() tensors on a CUDA rank.
  struct GroupBackends {
    c10::intrusive_ptr<c10d::Backend> host;
    c10::intrusive_ptr<c10d::Backend> device;  // null on CPU runs
    std::shared_ptr<SharedMemoryCollectives> shared_memory;  // null: off or not one host
  };
  GroupBackends make_backends(const std::vector<int>& ranks, int group_rank);
  c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                      int group_rank, int size);

  LaunchEnv env_;
  std::chrono::milliseconds timeout_;
  c10::Device device_;
  BackendKind device_backend_kind_;
  bool stage_device_tensors_;  // comm.device_transport = "host" on a GPU rank
  c10::intrusive_ptr<c10d::Store> store_;
  bool shared_memory_;
  // One Gloo transport device (one I/O loop) serves every group of this process.
  std::shared_ptr<gloo::transport::Device> gloo_device_;
  std::shared_ptr<Comm> world_;
  mutable std::mutex mutex_;  // guards timeout_ and backends_
  std::map<std::vector<int>, GroupBackends> backends_;
  std::unique_ptr<PeerAbort> peer_abort_;
  std::unique_ptr<CollectiveWatchdog> watchdog_;  // last: stops before anything else goes
};

// Rendezvous and world-group creation; starts the collective watchdog when the world has more than
// one rank. Also sets loom::log's rank and the intra-op thread count (see intra_op_threads).
// `device` is the rank's compute device (loom::select_device): CPU runs use Gloo alone, CUDA ranks
// NCCL for device tensors as well. Throws loom::Error naming the rendezvous address when it times
// out.
// `shared_memory`: see Distributed (comm.shared_memory in a job config).
std::shared_ptr<Distributed> init_distributed(const LaunchEnv& env,
                                              std::chrono::milliseconds timeout = kDefaultDistTimeout,
                                              c10::Device device = c10::Device(c10::kCPU),
                                              bool shared_memory = true,
                                              DeviceTransport transport = DeviceTransport::kNccl);

// The same, with the job config's [comm] section (its timeout and transport), so a new comm option
// reaches the process groups without the trainer naming it.
std::shared_ptr<Distributed> init_distributed(const LaunchEnv& env, const CommConfig& comm,
                                              c10::Device device);

// A world over `store` (a membership's own prefix in a store that outlives its ranks: elastic
// training, src/loom/elastic/), without the peer-failure monitor (a lost rank is survived, not
// echoed). `threads`: the intra-op threads to use (kept from the job's first layout, so a smaller
// membership computes as the larger one did).
std::shared_ptr<Distributed> init_distributed_over(const LaunchEnv& env, const CommConfig& comm,
                                                   c10::Device device,
                                                   c10::intrusive_ptr<c10d::Store> store, int threads);

// Intra-op threads for one rank: LOOM_NUM_THREADS, else OMP_NUM_THREADS, else the CPUs this
// process may run on divided by the ranks on this node (at least 1), so ranks do not oversubscribe.
int intra_op_threads(const LaunchEnv& env);

}  // namespace loom::distributed
