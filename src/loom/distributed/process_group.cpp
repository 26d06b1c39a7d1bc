#include "loom/distributed/process_group.h"

#include <ATen/Parallel.h>
#include <sched.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <charconv>
#include <csignal>
#include <cstdlib>
#include <set>
#include <thread>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/distributed/peer_abort.h"
#include "loom/distributed/shm_collectives.h"
#include "loom/distributed/watchdog.h"

namespace loom::distributed {
namespace {

std::optional<int> positive_env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  const std::string text(v);
  int value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  LOOM_REQUIRE_USAGE(ec == std::errc() && ptr == text.data() + text.size() && value >= 1, name,
                     "='", text, "' is not a positive integer; set it to the intra-op thread count");
  return value;
}

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Store prefix for a group: identical on every member, distinct for distinct rank lists.
std::string group_prefix(const std::vector<int>& ranks) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the ordered rank list
  for (int r : ranks) {
    for (int b = 0; b < 4; ++b) {
      h ^= static_cast<uint64_t>((static_cast<uint32_t>(r) >> (8 * b)) & 0xff);
      h *= 1099511628211ull;
    }
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return c10::str("loom/group/", ranks.size(), "/", ranks.front(), "/", hex, "/");
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

const char* to_string(BackendKind kind) {
  switch (kind) {
    case BackendKind::kGloo: return "gloo";
    case BackendKind::kNccl: return "nccl";
  }
  return "?";
}

BackendKind backend_kind_for(c10::Device device) {
  if (device.is_cpu()) return BackendKind::kGloo;
  LOOM_REQUIRE_USAGE(device.is_cuda(), "no process-group backend for tensors on ", device,
                     "; Loom runs on the CPU (Gloo) or on CUDA devices (NCCL)");
#ifndef USE_C10D_NCCL
  fail_usage("CUDA ranks communicate through NCCL, which is not compiled into this Loom build "
             "(libtorch without USE_C10D_NCCL); build against a CUDA torch or set "
             "training.device = \"cpu\"");
#endif
  return BackendKind::kNccl;
}

c10::intrusive_ptr<c10d::Backend> new_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int group_rank, int group_size,
                                                   std::chrono::milliseconds timeout,
                                                   c10::Device device,
                                                   const std::vector<int>& world_ranks) {
  LOOM_REQUIRE(device.is_cuda() && device.has_index(), "an NCCL group needs a CUDA device with an "
               "index (cuda:LOCAL_RANK), got ", device);
#ifdef USE_C10D_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  // Only for NCCL's own logs and flight recorder: the members' world ranks.
  for (int r : world_ranks) options->global_ranks_in_group.push_back(static_cast<uint64_t>(r));
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, group_rank, group_size, options);
  // One device per rank: binding it lets NCCL create the communicator now (every member is here,
  // creating the group) instead of lazily inside the first collective, where a failure would be
  // reported as that collective's.
  backend->setBoundDeviceId(device);
  backend->eagerConnectSingleDevice(device);
  return backend;
#else
  (void)store, (void)group_rank, (void)group_size, (void)timeout, (void)world_ranks;
  fail_usage("NCCL is not compiled into this Loom build (libtorch without USE_C10D_NCCL); build "
             "against a CUDA torch");
#endif
}

std::shared_ptr<Distributed> init_distributed(const LaunchEnv& env, const CommConfig& comm,
                                              c10::Device device) {
  return init_distributed(env, std::chrono::seconds(comm.timeout_seconds), device, comm.shared_memory,
                          comm.device_transport);
}

int intra_op_threads(const LaunchEnv& env) {
  if (auto n = positive_env_int("LOOM_NUM_THREADS")) return *n;
  if (auto n = positive_env_int("OMP_NUM_THREADS")) return *n;
  return std::max(1, usable_cpus() / std::max(1, env.local_world_size));
}

Distributed::Distributed(LaunchEnv env, std::chrono::milliseconds timeout, c10::Device device,
                         c10::intrusive_ptr<c10d::Store> store, bool shared_memory, DeviceTransport transport)
    : env_(std::move(env)),
      timeout_(timeout),
      device_(device),
      device_backend_kind_(transport == DeviceTransport::kHost ? BackendKind::kGloo : backend_kind_for(device)),
      stage_device_tensors_(transport == DeviceTransport::kHost && !device.is_cpu()),
      store_(std::move(store)),
      shared_memory_(shared_memory) {
  LOOM_REQUIRE(env_.world_size == 1 || store_, "a world of ", env_.world_size,
               " ranks needs a rendezvous store");
  std::vector<int> all(env_.world_size);
  for (int r = 0; r < env_.world_size; ++r) all[r] = r;
  world_ = new_group(all, "world");
  if (env_.world_size > 1) watchdog_ = std::make_unique<CollectiveWatchdog>(timeout_);
}

Distributed::~Distributed() = default;

std::chrono::milliseconds Distributed::timeout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return timeout_;
}

void Distributed::set_timeout(std::chrono::milliseconds timeout) {
  LOOM_REQUIRE_USAGE(timeout.count() > 0, "distributed timeout must be positive (got ",
                     timeout.count(), " ms)");
  std::lock_guard<std::mutex> lock(mutex_);
  timeout_ = timeout;
  for (auto& [ranks, backends] : backends_) {
    backends.host->setTimeout(backend_timeout_for(timeout));
    if (backends.device) backends.device->setTimeout(backend_timeout_for(timeout));
    if (backends.shared_memory) backends.shared_memory->set_timeout(backend_timeout_for(timeout));
  }
  if (watchdog_) watchdog_->set_timeout(timeout);
}

c10::intrusive_ptr<c10d::Backend> Distributed::make_gloo_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int group_rank, int size) {
  // One node: loopback. Across nodes: the interface named by GLOO_SOCKET_IFNAME, else the
  // address this host's name resolves to.
  if (!gloo_device_) {
    if (env_.single_node()) {
      gloo_device_ = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
    } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
      gloo_device_ = c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
    } else {
      gloo_device_ = c10d::ProcessGroupGloo::createDefaultDevice();
    }
  }
  auto options = c10d::ProcessGroupGloo::Options::create(backend_timeout_for(timeout_));
  options->devices.push_back(gloo_device_);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, group_rank, size, options);
}

Distributed::GroupBackends Distributed::make_backends(const std::vector<int>& ranks,
                                                      int group_rank) {
  const std::string prefix = group_prefix(ranks);
  const int size = static_cast<int>(ranks.size());
  GroupBackends out;
  out.host = make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>(prefix, store_), group_rank,
                               size);
  if (device_backend_kind_ == BackendKind::kNccl) {
    // Its own key space: NCCL's unique-id exchange must not meet Gloo's rendezvous keys.
    out.device = new_nccl_backend(c10::make_intrusive<c10d::PrefixStore>(prefix + "nccl/", store_),
                                  group_rank, size, backend_timeout_for(timeout_), device_, ranks);
  }
  // Ranks on one host: CPU all-gathers, reduce-scatters and all-reduces skip Gloo's TCP loopback.
  if (shared_memory_ && env_.single_node()) {
    // Its own Gloo backend, made only if a member runs out of room in /dev/shm mid-run.
    auto fallback_store = c10::make_intrusive<c10d::PrefixStore>(prefix + "shm-gloo/", store_);
    out.shared_memory = SharedMemoryCollectives::create(
        c10::make_intrusive<c10d::PrefixStore>(prefix + "shm/", store_), group_rank, size,
        backend_timeout_for(timeout_), [this, fallback_store, group_rank, size] {
          return make_gloo_backend(fallback_store, group_rank, size);
        });
  }
  return out;
}

std::shared_ptr<Comm> Distributed::new_group(const std::vector<int>& ranks,
                                             const std::string& name) {
  LOOM_REQUIRE(!ranks.empty(), "group '", name, "' has no ranks");
  std::set<int> distinct(ranks.begin(), ranks.end());
  LOOM_REQUIRE(distinct.size() == ranks.size(), "group '", name, "' lists a rank twice: [",
               rank_list(ranks), "]");
  LOOM_REQUIRE(*distinct.begin() >= 0 && *distinct.rbegin() < world_size(), "group '", name,
               "' ranks [", rank_list(ranks), "] fall outside the world of ", world_size());
  auto self = std::find(ranks.begin(), ranks.end(), rank());
  LOOM_REQUIRE(self != ranks.end(), "rank ", rank(), " is not a member of group '", name, "' [",
               rank_list(ranks), "]; only members create a group");
  const int group_rank = static_cast<int>(self - ranks.begin());
  if (ranks.size() == 1) return Comm::single(name, rank());

  std::lock_guard<std::mutex> lock(mutex_);
  auto it = backends_.find(ranks);
  if (it == backends_.end()) {
    GroupBackends backends;
    try {
      backends = make_backends(ranks, group_rank);
    } catch (const c10::Error& e) {
      fail("creating process group '", name, "' over ranks [", rank_list(ranks), "] failed on rank ",
           rank(), ": ", e.what_without_backtrace(), "; check that every member rank is alive");
    }
    it = backends_.emplace(ranks, std::move(backends)).first;
  }
  return std::make_shared<Comm>(it->second.host, name, ranks, group_rank, it->second.device,
                                device_, it->second.shared_memory, stage_device_tensors_);
}

void Distributed::enable_peer_abort() {
  if (env_.world_size > 1 && store_ && !peer_abort_) {
    peer_abort_ = std::make_unique<PeerAbort>(env_, store_);
  }
}

void Distributed::shutdown() {
  // Stop listening for peer failures first: once rank 0 passes the barrier its store may go away.
  if (peer_abort_) peer_abort_->stop();
  if (world_ && world_->size() > 1) world_->barrier();
  std::lock_guard<std::mutex> lock(mutex_);
  // NCCL wants an explicit shutdown (its destructor would otherwise abort the communicators and
  // warn); every rank is past the barrier, so no collective is in flight.
  for (auto& [ranks, backends] : backends_) {
    if (backends.device) backends.device->shutdown();
  }
  backends_.clear();
}

void Distributed::abandon() {
  if (peer_abort_) peer_abort_->stop();
  watchdog_.reset();
  flight_recorder().abandon_pending();
  // Never destroyed: see the header.
  static auto* graveyard = new std::vector<std::pair<c10::intrusive_ptr<c10d::Backend>,
                                                     std::shared_ptr<gloo::transport::Device>>>();
  std::map<std::vector<int>, GroupBackends> backends;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    backends.swap(backends_);
  }
  for (auto& [ranks, b] : backends) {
    graveyard->emplace_back(b.host, gloo_device_);
    if (b.device) graveyard->emplace_back(b.device, nullptr);
    b.shared_memory.reset();  // its waits end within one nap (50 ms) and its worker joins
  }
}

std::shared_ptr<Distributed> init_distributed(const LaunchEnv& env,
                                              std::chrono::milliseconds timeout,
                                              c10::Device device, bool shared_memory, DeviceTransport transport) {
  // A build without NCCL refuses a CUDA rank before rendezvous (unless staged through the host).
  if (transport == DeviceTransport::kNccl) (void)backend_kind_for(device);
  LOOM_REQUIRE_USAGE(timeout.count() > 0, "distributed timeout must be positive (got ",
                     timeout.count(), " ms)");
  log::set_rank(env.rank);
  at::set_num_threads(intra_op_threads(env));
  if (env.world_size == 1) return std::make_shared<Distributed>(env, timeout, device, nullptr, shared_memory, transport);
  // A peer that dies closes its sockets; writing to them must surface as an I/O error in the
  // collective (reported, attributable), not as a silent SIGPIPE death of this rank.
  std::signal(SIGPIPE, SIG_IGN);
  // `loom launch` stops the other ranks with SIGTERM when one fails: each leaves its flight record
  // (when the trainer set a file for it) before dying of the signal as before.
  dump_flight_recorder_on_sigterm();

  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(env.master_port);
  // Under a launcher that serves the store (torchrun, `loom launch`) every rank is a client, so
  // none waits for rank 0's process to start listening: a refused connection costs a client c10d's
  // retry backoff (hundreds of milliseconds at each start-up). Else rank 0 serves it.
  options.isServer = env.rank == 0 && !env.agent_store;
  options.numWorkers = static_cast<size_t>(env.world_size);
  options.waitWorkers = true;
  options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
    // The launcher's store outlives an attempt: each attempt's keys live under their own prefix
    // (torch.distributed's convention), so a restart never reads a failed attempt's keys.
    if (env.agent_store) {
      store = c10::make_intrusive<c10d::PrefixStore>(c10::str("/worker/attempt_", env.restart_count), store);
    }
  } catch (const c10::Error& e) {
    fail("rendezvous at ", env.master_addr, ":", env.master_port, " failed on rank ", env.rank,
         " of ", env.world_size, ": ", e.what_without_backtrace(),
         "; check MASTER_ADDR/MASTER_PORT and that all ", env.world_size, " ranks were started");
  }
  try {
    auto dist = std::make_shared<Distributed>(env, timeout, device, std::move(store),
                                              shared_memory, transport);
    dist->enable_peer_abort();
    return dist;
  } catch (const c10::Error& e) {
    fail("creating the world process group failed on rank ", env.rank, " of ", env.world_size,
         ": ", e.what_without_backtrace());
  }
}

std::shared_ptr<Distributed> init_distributed_over(const LaunchEnv& env, const CommConfig& comm,
                                                   c10::Device device,
                                                   c10::intrusive_ptr<c10d::Store> store, int threads) {
  if (comm.device_transport == DeviceTransport::kNccl) (void)backend_kind_for(device);
  log::set_rank(env.rank);
  at::set_num_threads(threads);
  const std::chrono::milliseconds timeout = std::chrono::seconds(comm.timeout_seconds);
  if (env.world_size == 1) {
    return std::make_shared<Distributed>(env, timeout, device, nullptr, comm.shared_memory, comm.device_transport);
  }
  std::signal(SIGPIPE, SIG_IGN);
  dump_flight_recorder_on_sigterm();
  try {
    return std::make_shared<Distributed>(env, timeout, device, std::move(store), comm.shared_memory,
                                         comm.device_transport);
  } catch (const c10::Error& e) {
    fail("creating the world process group failed on rank ", env.rank, " of ", env.world_size, ": ",
         e.what_without_backtrace());
  }
}

}  // namespace loom::distributed
