#include "loom/distributed/shm_collectives.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/StringUtil.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <random>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/memory.h"

namespace loom::distributed {
namespace {

// The first page of every segment. Only its owner writes it; peers read it and wait on `bell`.
struct Header {
  std::atomic<uint32_t> bell;      // futex word: bumped after every change below
  std::atomic<uint32_t> posted;    // the last operation whose contribution is in the data region
  std::atomic<uint32_t> finished;  // the last operation this rank has read from every peer
  std::atomic<uint32_t> failed;    // non-zero once the owner gave up: peers stop waiting for it
  std::atomic<int64_t> data_capacity;  // bytes of the data region (it only grows)
  std::atomic<int32_t> pid;            // the owner's process, watched by its peers
  // Non-zero: the operation from which the owner runs the group on Gloo (it had no room to post).
  std::atomic<uint32_t> gloo_from;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free,
              "process-shared atomics must be lock-free");
constexpr int64_t kHeaderBytes = 4096;
static_assert(sizeof(Header) <= kHeaderBytes);

// A process-shared futex (no FUTEX_PRIVATE_FLAG): the word lives in a mapping shared by processes.
long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

std::string errno_text() { return std::strerror(errno); }

// Thrown by wait_for when the awaited peer moved the group to Gloo (not a std::exception: it is a
// change of transport, not a failure).
struct PeerMovedToGloo {
  int peer;
};

// Test-only fault (LOOM_FAULT_SHM_LIMIT=<bytes>@<rank>): the rank of that global RANK behaves as if
// /dev/shm had room for only <bytes> of its segment, as a small tmpfs does.
int64_t fault_segment_limit() {
  static const int64_t limit = [] {
    const char* spec = std::getenv("LOOM_FAULT_SHM_LIMIT");
    const char* rank = std::getenv("RANK");
    if (spec == nullptr) return int64_t{-1};
    const std::string s(spec);
    const size_t at = s.find('@');
    if (at == std::string::npos || rank == nullptr || s.substr(at + 1) != rank) return int64_t{-1};
    return static_cast<int64_t>(std::stoll(s.substr(0, at)));
  }();
  return limit;
}

// Sums (or maxes) `parts` in rank order into `out`. Half-precision sums accumulate in fp32 and
// round once, as NCCL's and at::sum's do.
void reduce_into(at::Tensor out, const std::vector<at::Tensor>& parts, ReduceOp op) {
  const auto ranks = static_cast<int64_t>(parts.size());
  if (op == ReduceOp::kMax) {
    out.copy_(parts[0]);
    for (size_t i = 1; i < parts.size(); ++i) at::maximum_out(out, out, parts[i]);
    return;
  }
  const bool half = out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf;
  if (!half) {
    at::add_out(out, parts[0], parts[1]);
    for (size_t i = 2; i < parts.size(); ++i) out.add_(parts[i]);
    if (op == ReduceOp::kAvg) out.div_(ranks);
    return;
  }
  at::Tensor acc;
  {
    memory::UntrackedAllocationScope untracked;  // counted below as a communication buffer
    acc = parts[0].to(at::kFloat);
  }
  const int64_t acc_bytes = static_cast<int64_t>(acc.nbytes());
  memory::note_comm_buffer_bytes(out.device(), acc_bytes);
  for (size_t i = 1; i < parts.size(); ++i) acc.add_(parts[i]);
  if (op == ReduceOp::kAvg) acc.div_(ranks);
  out.copy_(acc);
  {
    memory::UntrackedAllocationScope untracked;
    acc.reset();
  }
  memory::note_comm_buffer_bytes(out.device(), -acc_bytes);
}

// A communication buffer of `numel` elements of `like`'s type: counted as one (core/memory.h), not
// as a tensor of the issuer's.
at::Tensor comm_scratch(const at::Tensor& like, int64_t numel) {
  at::Tensor t;
  {
    memory::UntrackedAllocationScope untracked;
    t = at::empty({numel}, like.options());
  }
  memory::note_comm_buffer_bytes(like.device(), static_cast<int64_t>(t.nbytes()));
  return t;
}
void release_scratch(at::Tensor& t) {
  const auto bytes = static_cast<int64_t>(t.nbytes());
  const c10::Device device = t.device();
  {
    memory::UntrackedAllocationScope untracked;
    t.reset();
  }
  memory::note_comm_buffer_bytes(device, -bytes);
}

}  // namespace

struct SharedMemoryCollectives::Segment {
  int fd = -1;
  int pidfd = -1;  // a peer's process (pidfd_open), readable once it has exited; -1: use kill(pid, 0)
  int32_t pid = 0;
  char* base = nullptr;  // mapping of [0, mapped_bytes)
  int64_t mapped_bytes = 0;

  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() {
    if (base != nullptr) ::munmap(base, static_cast<size_t>(mapped_bytes));
    if (fd >= 0) ::close(fd);
    if (pidfd >= 0) ::close(pidfd);
  }
  // Whether the owning process has exited (a peer that dies never rings its bell again).
  bool owner_exited() const {
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      return ::poll(&p, 1, 0) > 0 && (p.revents & POLLIN) != 0;
    }
    return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
  }
  Header* header() const { return reinterpret_cast<Header*>(base); }
  char* data() const { return base + kHeaderBytes; }
  // Maps the first `bytes` of the segment (remapping a smaller mapping); false with errno set.
  bool map(int64_t bytes) {
    void* p = base == nullptr
                  ? ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : ::mremap(base, static_cast<size_t>(mapped_bytes), static_cast<size_t>(bytes),
                             MREMAP_MAYMOVE);
    if (p == MAP_FAILED) return false;
    base = static_cast<char*>(p);
    mapped_bytes = bytes;
    return true;
  }
};

struct SharedMemoryCollectives::Job {
  c10::intrusive_ptr<SharedMemoryCollectives::Work> work;
  // The issuing thread's debug info (Loom's allocation tracker, the profiler): the worker runs and
  // drops the job under it, so the frees of tensors whose last reference the job held are reported
  // to the tracker that saw them allocated (c10 reports per thread; a free reported nowhere would
  // stay counted for good).
  std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info;
  at::Tensor contribution;  // what this rank posts (contiguous; its bytes are copied in)
  std::function<void(const std::vector<const char*>&)> combine;  // reads every rank's data
  // The same operation on the group's fallback Gloo backend, with the same result bit for bit
  // (every rank's contribution gathered, then combined in rank order), run to completion.
  std::function<void(c10d::Backend&)> on_gloo;
  const char* what = "";
};

// Completion is observable through wait(timeout), isCompleted() and the future (which closes the
// flight record on the worker thread).
class SharedMemoryCollectives::Work : public c10d::Work {
 public:
  Work(int rank, c10d::OpType type, at::Tensor result)
      : c10d::Work(rank, type),
        result_(std::move(result)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors())) {}

  void complete(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      done_ = true;
      error_ = error;
    }
    done_cv_.notify_all();
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{result_}));
    }
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(state_mutex_);
    return done_;
  }
  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(state_mutex_);
    return done_ && !error_;
  }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(state_mutex_);
    return error_;
  }
  std::vector<at::Tensor> result() override { return {result_}; }
  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(state_mutex_);
    if (timeout == kNoTimeout) {
      done_cv_.wait(lock, [&] { return done_; });
    } else if (!done_cv_.wait_for(lock, timeout, [&] { return done_; })) {
      TORCH_CHECK(false, "shared-memory collective did not complete within ", timeout.count(), " ms");
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  at::Tensor result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  mutable std::mutex state_mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

std::unique_ptr<SharedMemoryCollectives> SharedMemoryCollectives::create(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, BackendFactory make_fallback) {
  std::unique_ptr<SharedMemoryCollectives> group(
      new SharedMemoryCollectives(rank, size, timeout, std::move(make_fallback)));
  // 1. This rank's segment, under a name no other process uses.
  static std::atomic<uint64_t> created{0};
  std::random_device entropy;
  const std::string own_name = c10::str("/loom-", ::getpid(), "-", created.fetch_add(1), "-",
                                        entropy() % 1000000, "-r", rank);
  std::string problem;
  auto own = std::make_unique<Segment>();
  own->fd = ::shm_open(own_name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (own->fd < 0) {
    problem = c10::str("shm_open(", own_name, "): ", errno_text());
  } else if (::ftruncate(own->fd, kHeaderBytes) != 0 || !own->map(kHeaderBytes)) {
    problem = c10::str("sizing ", own_name, ": ", errno_text());
  } else {
    new (own->header()) Header{};  // zeroed by ftruncate; constructed for the record
    own->header()->pid.store(static_cast<int32_t>(::getpid()), std::memory_order_release);
  }
  // 2. Every member publishes its name (empty: it could not create one) and opens the others'.
  store->set(c10::str("name/", rank), std::vector<uint8_t>(problem.empty() ? own_name.begin() : own_name.end(),
                                                             own_name.end()));
  group->segments_.resize(static_cast<size_t>(size));
  for (int peer = 0; peer < size && problem.empty(); ++peer) {
    if (peer == rank) continue;
    const std::vector<uint8_t> bytes = store->get(c10::str("name/", peer));
    const std::string name(bytes.begin(), bytes.end());
    if (name.empty()) {
      problem = c10::str("group rank ", peer, " could not create its segment");
      break;
    }
    auto segment = std::make_unique<Segment>();
    segment->fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (segment->fd < 0 || !segment->map(kHeaderBytes)) {
      problem = c10::str("opening group rank ", peer, "'s segment ", name, ": ", errno_text());
      break;
    }
    segment->pid = segment->header()->pid.load(std::memory_order_acquire);
    segment->pidfd = static_cast<int>(::syscall(SYS_pidfd_open, segment->pid, 0));
    group->segments_[static_cast<size_t>(peer)] = std::move(segment);
  }
  // 3. All agree before anyone uses the group or unlinks: one failure turns it off everywhere.
  store->set(c10::str("opened/", rank), std::vector<uint8_t>{problem.empty() ? uint8_t{1} : uint8_t{0}});
  bool everyone = problem.empty();
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    const std::vector<uint8_t> ok = store->get(c10::str("opened/", peer));
    if (ok.empty() || ok[0] != 1) {
      everyone = false;
      if (problem.empty()) problem = c10::str("group rank ", peer, " could not open the segments");
    }
  }
  if (own->fd >= 0) ::shm_unlink(own_name.c_str());  // every member holds it open (or gave up)
  if (!everyone) {
    log::warn("shared-memory collectives are off for this group (", problem,
              "); its CPU collectives use Gloo");
    return nullptr;
  }
  group->segments_[static_cast<size_t>(rank)] = std::move(own);
  group->worker_ = std::thread([g = group.get()] { g->worker_loop(); });
  return group;
}

SharedMemoryCollectives::SharedMemoryCollectives(int rank, int size, std::chrono::milliseconds timeout,
                                                 BackendFactory make_fallback)
    : rank_(rank), size_(size), timeout_(timeout), make_fallback_(std::move(make_fallback)) {
  LOOM_REQUIRE(size >= 2 && rank >= 0 && rank < size, "shared-memory group: rank ", rank, " of ",
               size);
}

SharedMemoryCollectives::~SharedMemoryCollectives() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  stopping_.store(true);
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void SharedMemoryCollectives::set_timeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeout_ = timeout;
  if (fallback_) fallback_->setTimeout(timeout);
}

int64_t SharedMemoryCollectives::segment_bytes() const {
  const auto& own = segments_[static_cast<size_t>(rank_)];
  return kHeaderBytes + own->header()->data_capacity.load(std::memory_order_acquire);
}

WorkHandle SharedMemoryCollectives::all_gather(at::Tensor output, at::Tensor input) {
  auto job = std::make_shared<Job>();
  job->work = c10::make_intrusive<Work>(rank_, c10d::OpType::_ALLGATHER_BASE, output);
  job->what = "all_gather";
  job->contribution = input;
  const auto shard_bytes = static_cast<size_t>(input.nbytes());
  auto* out = static_cast<char*>(output.data_ptr());
  const char* own_input = static_cast<const char*>(input.data_ptr());
  const int me = rank_;
  job->combine = [out, own_input, shard_bytes, me](const std::vector<const char*>& data) {
    for (size_t r = 0; r < data.size(); ++r) {
      std::memcpy(out + r * shard_bytes, static_cast<int>(r) == me ? own_input : data[r], shard_bytes);
    }
  };
  job->on_gloo = [output, input](c10d::Backend& gloo) {
    at::Tensor out = output, in = input;
    gloo._allgather_base(out, in)->wait();
  };
  return enqueue(std::move(job));
}

WorkHandle SharedMemoryCollectives::reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op) {
  auto job = std::make_shared<Job>();
  job->work = c10::make_intrusive<Work>(rank_, c10d::OpType::_REDUCE_SCATTER_BASE, output);
  job->what = "reduce_scatter";
  job->contribution = input;
  const int64_t chunk = output.numel();
  const auto offset = static_cast<size_t>(rank_) * static_cast<size_t>(output.nbytes());
  const auto options = output.options();
  job->combine = [output, chunk, offset, options, op](const std::vector<const char*>& data) {
    std::vector<at::Tensor> parts;
    parts.reserve(data.size());
    for (const char* d : data) {
      parts.push_back(at::from_blob(const_cast<char*>(d + offset), {chunk}, options));
    }
    reduce_into(output, parts, op);
  };
  job->on_gloo = [output, input, chunk, op, size = size_](c10d::Backend& gloo) {
    // Every rank's copy of this rank's chunk, by one all-to-all, summed in rank order.
    at::Tensor received = comm_scratch(input, input.numel());
    at::Tensor in = input;
    std::vector<int64_t> equal_splits;
    gloo.alltoall_base(received, in, equal_splits, equal_splits)->wait();
    std::vector<at::Tensor> parts;
    for (int r = 0; r < size; ++r) parts.push_back(received.narrow(0, r * chunk, chunk));
    reduce_into(output, parts, op);
    release_scratch(received);
  };
  return enqueue(std::move(job));
}

WorkHandle SharedMemoryCollectives::all_reduce(at::Tensor tensor, ReduceOp op) {
  auto job = std::make_shared<Job>();
  job->work = c10::make_intrusive<Work>(rank_, c10d::OpType::ALLREDUCE, tensor);
  job->what = "all_reduce";
  job->contribution = tensor;
  const at::Tensor flat = tensor.view({-1});
  job->combine = [flat, op](const std::vector<const char*>& data) {
    // In place: this rank's own contribution is read back from its segment, like the peers'.
    std::vector<at::Tensor> parts;
    parts.reserve(data.size());
    for (const char* d : data) {
      parts.push_back(at::from_blob(const_cast<char*>(d), {flat.numel()}, flat.options()));
    }
    reduce_into(flat, parts, op);
  };
  job->on_gloo = [flat, op, size = size_](c10d::Backend& gloo) {
    // Every rank's tensor gathered, then reduced in rank order as above.
    at::Tensor gathered = comm_scratch(flat, flat.numel() * size);
    at::Tensor in = flat;
    gloo._allgather_base(gathered, in)->wait();
    const int64_t n = flat.numel();
    std::vector<at::Tensor> parts;
    for (int r = 0; r < size; ++r) parts.push_back(gathered.narrow(0, r * n, n));
    reduce_into(flat, parts, op);
    release_scratch(gathered);
  };
  return enqueue(std::move(job));
}

WorkHandle SharedMemoryCollectives::enqueue(std::shared_ptr<Job> job) {
  WorkHandle handle = job->work;
  job->debug_info = c10::ThreadLocalDebugInfo::current();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
  return handle;
}

void SharedMemoryCollectives::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    std::string failed;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping with nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
      if (stop_ && failed_.empty()) failed_ = "the group was shut down with the collective pending";
      failed = failed_;
    }
    c10::DebugInfoGuard issuer(job->debug_info);
    std::exception_ptr error;
    if (!failed.empty()) {
      error = std::make_exception_ptr(Error(c10::str("shared-memory ", job->what, ": ", failed)));
    } else {
      try {
        run(*job);
      } catch (const std::exception& e) {
        mark_failed();
        {
          std::lock_guard<std::mutex> lock(mutex_);
          if (failed_.empty()) failed_ = e.what();
        }
        error = std::make_exception_ptr(Error(c10::str("shared-memory ", job->what, " on group rank ",
                                                       rank_, ": ", e.what())));
      }
    }
    const c10::intrusive_ptr<Work> work = std::move(job->work);
    job.reset();  // the tensors it held, released under the issuer's debug info
    work->complete(error);
  }
}

void SharedMemoryCollectives::run(const Job& job) {
  const uint32_t op = ++next_op_;
  if (on_gloo_since_.load() != 0) {
    job.on_gloo(*fallback_);
    return;
  }
  Segment& own = *segments_[static_cast<size_t>(rank_)];
  const auto bytes = static_cast<int64_t>(job.contribution.nbytes());
  // 1. Every peer has read this rank's previous contribution: its data region may be overwritten.
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    Segment& s = *segments_[static_cast<size_t>(peer)];
    wait_for(peer, [&] { return s.header()->finished.load(std::memory_order_acquire) + 1 >= op; },
             "finish the previous collective", op);
  }
  // 2. Post this rank's contribution, or, without room for it, that the group moves to Gloo.
  std::string no_room;
  if (!ensure_own_capacity(bytes, no_room)) {
    own.header()->gloo_from.store(op, std::memory_order_release);
    ring_own_bell();
    move_to_gloo(op, no_room);
    job.on_gloo(*fallback_);
    return;
  }
  if (bytes > 0) std::memcpy(own.data(), job.contribution.data_ptr(), static_cast<size_t>(bytes));
  own.header()->posted.store(op, std::memory_order_release);
  ring_own_bell();
  // 3. Read every rank's, in rank order, once posted.
  std::vector<const char*> data(static_cast<size_t>(size_));
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) {
      data[static_cast<size_t>(peer)] = own.data();
      continue;
    }
    Segment& s = *segments_[static_cast<size_t>(peer)];
    try {
      wait_for(peer, [&] { return s.header()->posted.load(std::memory_order_acquire) >= op; },
               "post its contribution", op);
    } catch (const PeerMovedToGloo& moved) {
      move_to_gloo(op, c10::str("group rank ", moved.peer, " has no room for it in its shared memory"));
      job.on_gloo(*fallback_);
      return;
    }
    data[static_cast<size_t>(peer)] = peer_data(peer, bytes);
  }
  job.combine(data);
  own.header()->finished.store(op, std::memory_order_release);
  ring_own_bell();
}

void SharedMemoryCollectives::move_to_gloo(uint32_t op, const std::string& reason) {
  log::warn("shared-memory collective #", op, " of this group: ", reason,
            "; this group's CPU collectives continue on Gloo from this one on (free space in /dev/shm, "
            "`df -h /dev/shm`, to keep them on shared memory)");
  auto fallback = make_fallback_();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fallback->setTimeout(timeout_);
    fallback_ = std::move(fallback);
  }
  on_gloo_since_.store(op);
}

void SharedMemoryCollectives::ring_own_bell() {
  Header* h = segments_[static_cast<size_t>(rank_)]->header();
  h->bell.fetch_add(1, std::memory_order_acq_rel);
  futex(&h->bell, FUTEX_WAKE, INT_MAX, nullptr);
}

void SharedMemoryCollectives::mark_failed() {
  const auto& own = segments_[static_cast<size_t>(rank_)];
  if (!own) return;
  own->header()->failed.store(1, std::memory_order_release);
  ring_own_bell();
}

void SharedMemoryCollectives::wait_for(int peer, const std::function<bool()>& ready,
                                       const char* what, uint32_t op) {
  std::chrono::milliseconds timeout;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    timeout = timeout_;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    Header* h = segments_[static_cast<size_t>(peer)]->header();
    const uint32_t bell = h->bell.load(std::memory_order_acquire);
    if (ready()) return;
    if (h->failed.load(std::memory_order_acquire) != 0) {
      fail("group rank ", peer, " failed its shared-memory collectives (see its error)");
    }
    if (h->gloo_from.load(std::memory_order_acquire) != 0) {
      if (ready()) return;  // what it did before moving (ordered before the flag) counts
      throw PeerMovedToGloo{peer};
    }
    if (segments_[static_cast<size_t>(peer)]->owner_exited()) {
      fail("group rank ", peer, " (pid ", segments_[static_cast<size_t>(peer)]->pid,
           ") exited before it could ", what, " (collective #", op, " on this group)");
    }
    if (stopping_.load()) fail("the group was shut down while waiting for group rank ", peer);
    if (std::chrono::steady_clock::now() > deadline) {
      fail("group rank ", peer, " did not ", what, " (collective #", op, " on this group) within ",
           timeout.count() / 1000.0, " s");
    }
    // Sleep until the peer rings (or 50 ms pass, to notice a shutdown or the deadline).
    const timespec nap{0, 50 * 1000 * 1000};
    futex(&h->bell, FUTEX_WAIT, bell, &nap);
  }
}

bool SharedMemoryCollectives::ensure_own_capacity(int64_t bytes, std::string& problem) {
  Segment& own = *segments_[static_cast<size_t>(rank_)];
  const int64_t capacity = own.header()->data_capacity.load(std::memory_order_relaxed);
  if (bytes <= capacity) return true;
  // Grow to the next MiB-rounded size with headroom, so a few sizes do not regrow each time.
  constexpr int64_t kMiB = int64_t{1} << 20;
  const int64_t target = std::max(bytes, capacity + capacity / 2);
  const int64_t grown = (target + kMiB - 1) / kMiB * kMiB;
  // Reserve the pages now: a tmpfs without room then says so here, instead of a SIGBUS at the
  // first write.
  const int64_t limit = fault_segment_limit();
  const int rc = limit >= 0 && kHeaderBytes + grown > limit ? ENOSPC
                                                            : ::posix_fallocate(own.fd, 0, kHeaderBytes + grown);
  if (rc != 0) {
    problem = c10::str("cannot grow this rank's segment to ", grown / kMiB, " MiB for ", bytes, " bytes (",
                       std::strerror(rc), limit >= 0 ? ", LOOM_FAULT_SHM_LIMIT" : "", ")");
    return false;
  }
  if (!own.map(kHeaderBytes + grown)) {
    problem = c10::str("cannot map ", grown / kMiB, " MiB of shared memory (", errno_text(), ")");
    return false;
  }
  own.header()->data_capacity.store(grown, std::memory_order_release);
  return true;
}

const char* SharedMemoryCollectives::peer_data(int peer, int64_t bytes) {
  Segment& s = *segments_[static_cast<size_t>(peer)];
  if (s.mapped_bytes < kHeaderBytes + bytes) {
    const int64_t capacity = s.header()->data_capacity.load(std::memory_order_acquire);
    LOOM_REQUIRE(capacity >= bytes, "group rank ", peer, " posted ", bytes,
                 " bytes into a segment of ", capacity);
    if (!s.map(kHeaderBytes + capacity)) {
      fail("cannot map group rank ", peer, "'s shared memory (", capacity, " bytes): ", errno_text());
    }
  }
  return s.data();
}

}  // namespace loom::distributed
