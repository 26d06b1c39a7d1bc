#include "loom/distributed/comm.h"

#include <ATen/record_function.h>

#include <c10/util/StringUtil.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <ctime>
#include <fstream>
#include <numeric>
#include <thread>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/core/logging.h"
#include "loom/distributed/shm_collectives.h"

namespace loom::distributed {
namespace {

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f%s" : "%.2f%s", bytes, units[u]);
  return buf;
}

std::string format_shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

c10d::OpType op_type(CommOp op) {
  switch (op) {
    case CommOp::kAllReduce: return c10d::OpType::ALLREDUCE;
    case CommOp::kAllGather: return c10d::OpType::_ALLGATHER_BASE;
    case CommOp::kReduceScatter: return c10d::OpType::_REDUCE_SCATTER_BASE;
    case CommOp::kBroadcast: return c10d::OpType::BROADCAST;
    case CommOp::kAllToAll: return c10d::OpType::ALLTOALL_BASE;
    case CommOp::kSend: return c10d::OpType::SEND;
    case CommOp::kRecv: return c10d::OpType::RECV;
    case CommOp::kBarrier: return c10d::OpType::BARRIER;
  }
  return c10d::OpType::UNKNOWN;
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return c10d::ReduceOp::SUM;
    case ReduceOp::kAvg: return c10d::ReduceOp::AVG;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

struct InterruptState {
  std::atomic<bool> interruptible{false};
  std::atomic<bool> interrupted{false};
  std::mutex mutex;
  std::condition_variable cv;
  std::string reason;
  // Wakers of waits that cannot be woken through a future (Gloo's send/recv: their abort()).
  std::map<uint64_t, std::function<void()>> wakers;
  uint64_t next_waker = 0;
};

InterruptState& interrupt_state() {
  static InterruptState state;
  return state;
}

[[noreturn]] void throw_interrupted(const std::string& what) {
  auto& s = interrupt_state();
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    reason = s.reason;
  }
  throw CollectivesInterrupted(c10::str(what, " abandoned: ", reason));
}

// Wraps the backend's work so that completion (observed through wait() or isCompleted()) runs the
// collective's post-processing exactly once and closes its flight record.
class CommWork : public c10d::Work {
 public:
  // `record` identifies the collective in error messages; record.seq == 0: not recorded.
  // `dim`: the group's mesh dim, under which the time callers wait is counted (empty: not counted).
  // `host_threads`: the backend completes the work on its own threads (Gloo, the shared-memory
  // worker), which drop their reference to it just after completing it.
  CommWork(int rank, CommOp op, WorkHandle inner, std::function<void()> finalize,
           FlightRecord record, std::string dim = {}, bool host_threads = false)
      : c10d::Work(rank, op_type(op)),
        inner_(std::move(inner)),
        host_threads_(host_threads),
        finalize_(std::move(finalize)),
        record_(std::move(record)),
        op_(op),
        dim_(std::move(dim)) {}

  // A collective that was complete when issued (groups of one rank).
  static WorkHandle completed(int rank, CommOp op) {
    auto work = c10::make_intrusive<CommWork>(rank, op, WorkHandle(), nullptr, FlightRecord{});
    work->settle(nullptr);
    return work;
  }

  bool isCompleted() override {
    if (settled_.load()) return true;
    if (inner_ && !inner_->isCompleted()) return false;
    settle_from_inner(kNoTimeout);
    return true;
  }

  // A timeout that expires counts as a failure: collectives are ordered per group, so a group whose
  // collective did not finish cannot be used further anyway.
  bool wait(std::chrono::milliseconds timeout) override {
    if (!settled_.load()) {
      // The time the caller is blocked here is the collective's exposed communication.
      const auto start = std::chrono::steady_clock::now();
      // A profiler trace shows the wait as its own range on the waiting thread.
      RECORD_USER_SCOPE(c10::str("comm_wait ", to_string(op_), "@", dim_));  // a std::string: copied
      settle_from_inner(timeout);
      if (!dim_.empty()) {
        comm_stats().record_wait(op_, dim_,
                                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }

  void abort() override {
    if (inner_) inner_->abort();
  }

  uint64_t getSequencenumber() const override { return record_.seq; }

 private:
  // A backend failure (a peer that died closes its connections; Gloo raises once its timeout
  // passes) becomes one loom::Error naming the collective, so the rank's last words say which
  // collective on which group broke, not just the transport's complaint.
  // With collectives interruptible: returns once the backend's work completed, or throws
  // CollectivesInterrupted (leaving the work unsettled and its record to abandon_pending()).
  // Returns true when it already waited on the backend's work (Gloo's send/recv: a second wait
  // would block for good, their completions are counted), with `error` what that wait threw.
  bool wait_interruptibly(std::exception_ptr& error) {
    auto& s = interrupt_state();
    if (!inner_ || !s.interruptible.load()) return false;
    if (s.interrupted.load()) throw_interrupted(describe(record_));
    // Gloo's send/recv works have no future that completes (their completion is only observable
    // through wait()).
    const bool gloo_point_to_point = host_threads_ && (op_ == CommOp::kSend || op_ == CommOp::kRecv);
    if (!gloo_point_to_point) {
      c10::intrusive_ptr<c10::ivalue::Future> future;
      try {
        future = inner_->getFuture();
      } catch (const std::exception&) {
      }
      if (!future) return false;
      auto done = std::make_shared<std::atomic<bool>>(false);
      future->addCallback([done](c10::ivalue::Future&) {
        auto& st = interrupt_state();
        {
          std::lock_guard<std::mutex> lock(st.mutex);
          done->store(true);
        }
        st.cv.notify_all();
      });
      std::unique_lock<std::mutex> lock(s.mutex);
      s.cv.wait(lock, [&] { return done->load() || s.interrupted.load(); });
      if (!done->load()) {
        lock.unlock();
        throw_interrupted(describe(record_));
      }
      return false;
    }
    // An interrupt aborts the backend's wait, which then throws.
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      id = s.next_waker++;
      WorkHandle inner = inner_;
      s.wakers[id] = [inner] { inner->abort(); };
    }
    try {
      if (!s.interrupted.load()) inner_->wait(kNoTimeout);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.wakers.erase(id);
    }
    if (s.interrupted.load()) throw_interrupted(describe(record_));
    return true;
  }

  void settle_from_inner(std::chrono::milliseconds timeout) {
    std::exception_ptr waited_error;
    const bool waited = wait_interruptibly(waited_error);
    std::exception_ptr error;
    try {
      if (waited_error) std::rethrow_exception(waited_error);
      if (inner_ && !waited) inner_->wait(timeout);
    } catch (const c10::Error& e) {
      error = std::make_exception_ptr(named_failure(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(named_failure(e.what()));
    }
    release_inner();
    if (error && record_.seq != 0) {
      // A broken collective ends the run: the rank's last collectives go to its flight-recorder
      // file (when the trainer set one) before the error unwinds.
      flight_recorder().finish(record_.seq, false);
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        flight_recorder().dump_to_file(c10::str("collective failed: ", e.what()));
      }
    }
    settle(error);
  }

  // The backend's work holds the collective's tensors. A backend thread that completed it drops
  // its reference a moment later; if that were the last one, the tensors would be freed on that
  // thread, where c10 reports the free to no allocation tracker (reporting is per thread), and
  // the memory breakdown would count them for good ("other" growing every step). So the caller's
  // thread waits for that moment (microseconds; bounded) and drops the work itself.
  void release_inner() {
    if (!inner_ || !host_threads_) return;
    for (int i = 0; i < 10000 && inner_.use_count() > 1; ++i) std::this_thread::yield();
    inner_.reset();
  }

  Error named_failure(const std::string& cause) const {
    return Error(c10::str(describe(record_), " failed on group rank ", rank_, ": ", cause));
  }

  void settle(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(settle_mutex_);
    if (settled_.load()) return;
    if (!error && finalize_) {
      try {
        finalize_();
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (record_.seq != 0) flight_recorder().finish(record_.seq, error == nullptr);
    finish(error);
    settled_.store(true);
  }

  WorkHandle inner_;
  bool host_threads_ = false;
  std::function<void()> finalize_;
  FlightRecord record_;
  CommOp op_;
  std::string dim_;
  std::mutex settle_mutex_;
  std::atomic<bool> settled_{false};
};

void require_dense(const at::Tensor& t, const char* op, const char* what) {
  LOOM_REQUIRE(t.defined(), op, ": ", what, " tensor is undefined");
  LOOM_REQUIRE(t.layout() == at::kStrided && t.is_contiguous(), op, ": ", what,
               " tensor must be dense and contiguous (got sizes ", t.sizes(), ", strides ",
               t.strides(), "); pass .contiguous()");
}

void require_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op) {
  LOOM_REQUIRE(a.scalar_type() == b.scalar_type(), op, ": output dtype ", a.scalar_type(),
               " differs from input dtype ", b.scalar_type());
}

void require_same_device(const at::Tensor& a, const at::Tensor& b, const char* op) {
  LOOM_REQUIRE(a.device() == b.device(), op, ": output on ", a.device(), " but input on ",
               b.device(), "; both must be on the same device");
}

void require_avg_dtype(const at::Tensor& t, ReduceOp op, const char* name) {
  LOOM_REQUIRE(op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), name,
               ": ReduceOp avg needs a floating-point tensor (got ", t.scalar_type(),
               "); reduce with sum and divide explicitly");
}

}  // namespace

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

const char* to_string(CommOp op) {
  switch (op) {
    case CommOp::kAllReduce: return "all_reduce";
    case CommOp::kAllGather: return "all_gather";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kAllToAll: return "all_to_all";
    case CommOp::kSend: return "send";
    case CommOp::kRecv: return "recv";
    case CommOp::kBarrier: return "barrier";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Accounting

ByteCount ByteCount::fraction(int64_t numerator, int64_t denominator) {
  TORCH_CHECK(denominator > 0 && numerator >= 0, "ByteCount needs numerator >= 0, denominator > 0");
  const int64_t g = std::gcd(numerator, denominator);
  return {numerator / g, denominator / g};
}

ByteCount& ByteCount::operator+=(const ByteCount& other) {
  const int64_t l = std::lcm(denominator, other.denominator);
  *this = fraction(numerator * (l / denominator) + other.numerator * (l / other.denominator), l);
  return *this;
}

ByteCount ring_wire_bytes(CommOp op, int64_t payload_bytes, int group_size) {
  const int64_t w = group_size;
  if (w <= 1) return {};
  switch (op) {
    case CommOp::kAllGather:
    case CommOp::kReduceScatter:
    case CommOp::kAllToAll:
      return ByteCount::fraction(payload_bytes * (w - 1), w);
    case CommOp::kAllReduce:
      return ByteCount::fraction(2 * payload_bytes * (w - 1), w);
    case CommOp::kBroadcast:
    case CommOp::kSend:
      return ByteCount::exact(payload_bytes);
    case CommOp::kRecv:  // the sender counts the bytes; counting them here too would double them
    case CommOp::kBarrier:
      return {};
  }
  return {};
}

CommCounter& CommCounter::operator+=(const CommCounter& other) {
  calls += other.calls;
  payload_bytes += other.payload_bytes;
  wire_bytes += other.wire_bytes;
  wait_seconds += other.wait_seconds;
  return *this;
}

CommCounter CommSnapshot::get(CommOp op, const std::string& dim) const {
  auto it = counters.find({op, dim});
  return it == counters.end() ? CommCounter{} : it->second;
}

CommCounter CommSnapshot::total() const {
  CommCounter sum;
  for (const auto& [key, c] : counters) sum += c;
  return sum;
}

CommCounter CommSnapshot::total_for_dim(const std::string& dim) const {
  CommCounter sum;
  for (const auto& [key, c] : counters) {
    if (key.second == dim) sum += c;
  }
  return sum;
}

std::string CommSnapshot::format() const {
  std::string out;
  for (const auto& [key, c] : counters) {
    out += c10::str(to_string(key.first), "@", key.second, " calls=", c.calls,
                    " payload=", format_bytes(static_cast<double>(c.payload_bytes)),
                    " wire=", format_bytes(c.wire_bytes.value()), " waited=", c.wait_seconds * 1e3, "ms\n");
  }
  return out;
}

void CommStats::record(CommOp op, const std::string& dim, int64_t payload_bytes,
                       ByteCount wire_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& c = current_.counters[{op, dim}];
  c.calls += 1;
  c.payload_bytes += payload_bytes;
  c.wire_bytes += wire_bytes;
}

void CommStats::record_wait(CommOp op, const std::string& dim, double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  current_.counters[{op, dim}].wait_seconds += seconds;
}

CommSnapshot CommStats::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return current_;
}

void CommStats::restore(CommSnapshot snapshot) {
  std::lock_guard<std::mutex> lock(mutex_);
  current_ = std::move(snapshot);
}

void CommStats::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  current_.counters.clear();
}

CommStats& comm_stats() {
  static CommStats stats;
  return stats;
}

// ---------------------------------------------------------------------------------------------
// Flight recorder

std::string describe(const FlightRecord& r) {
  std::string s = c10::str(to_string(r.op), " ", r.group, " gseq=", r.group_seq);
  if (r.peer >= 0) s += c10::str(r.op == CommOp::kBroadcast ? " root=" : " peer=", r.peer);
  if (r.op != CommOp::kBarrier) {
    s += c10::str(" in=", format_shape(r.input_shape), " out=", format_shape(r.output_shape), " ",
                  c10::toString(r.dtype), " ", format_bytes(static_cast<double>(r.payload_bytes)));
  }
  return s;
}

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {}

uint64_t FlightRecorder::start(FlightRecord record) {
  std::lock_guard<std::mutex> lock(mutex_);
  record.seq = next_seq_++;
  record.state = FlightRecord::State::kPending;
  ring_.push_back(std::move(record));
  while (ring_.size() > capacity_) ring_.pop_front();
  return ring_.back().seq;
}

void FlightRecorder::finish(uint64_t seq, bool success) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = ring_.rbegin(); it != ring_.rend(); ++it) {
    if (it->seq == seq) {
      if (it->state != FlightRecord::State::kPending) return;
      it->state = success ? FlightRecord::State::kCompleted : FlightRecord::State::kFailed;
      it->duration = std::chrono::steady_clock::now() - it->started_steady;
      return;
    }
    if (it->seq < seq) return;  // already rotated out
  }
}

std::vector<FlightRecord> FlightRecorder::records() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {ring_.begin(), ring_.end()};
}

std::optional<FlightRecord> FlightRecorder::oldest_pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& r : ring_) {
    if (r.state == FlightRecord::State::kPending) return r;
  }
  return std::nullopt;
}

std::string FlightRecorder::dump() const {
  const auto records_copy = records();
  const auto now = std::chrono::steady_clock::now();
  std::string out;
  for (const auto& r : records_copy) {
    const std::time_t t = std::chrono::system_clock::to_time_t(r.started_at);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        r.started_at.time_since_epoch()).count() % 1000;
    std::tm tm{};
    localtime_r(&t, &tm);
    char when[32];
    std::snprintf(when, sizeof(when), "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec,
                  static_cast<int>(ms));
    std::string line = c10::str("#", r.seq, " ", describe(r), " started ", when);
    auto millis = [](std::chrono::steady_clock::duration d) {
      return std::chrono::duration<double, std::milli>(d).count();
    };
    char dur[64];
    switch (r.state) {
      case FlightRecord::State::kCompleted:
        std::snprintf(dur, sizeof(dur), " completed in %.2f ms", millis(*r.duration));
        break;
      case FlightRecord::State::kFailed:
        std::snprintf(dur, sizeof(dur), " FAILED after %.2f ms", millis(*r.duration));
        break;
      case FlightRecord::State::kPending:
        std::snprintf(dur, sizeof(dur), " PENDING for %.2f ms", millis(now - r.started_steady));
        break;
    }
    out += line + dur + "\n";
  }
  return out;
}

void FlightRecorder::set_capacity(size_t capacity) {
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_ = std::max<size_t>(capacity, 1);
  while (ring_.size() > capacity_) ring_.pop_front();
}

size_t FlightRecorder::capacity() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_;
}

void FlightRecorder::abandon_pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (FlightRecord& r : ring_) {
    if (r.state != FlightRecord::State::kPending) continue;
    r.state = FlightRecord::State::kFailed;
    r.duration = std::chrono::steady_clock::now() - r.started_steady;
  }
}

void FlightRecorder::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  ring_.clear();
}

std::string FlightRecorder::to_json(const std::string& reason) const {
  const auto records_copy = records();
  const auto now_steady = std::chrono::steady_clock::now();
  auto micros_since_epoch = [](std::chrono::system_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  };
  auto millis = [](std::chrono::steady_clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  };
  nlohmann::json records = nlohmann::json::array();
  for (const FlightRecord& r : records_copy) {
    nlohmann::json j = {{"seq", r.seq},
                        {"group_seq", r.group_seq},
                        {"op", to_string(r.op)},
                        {"group", r.group},
                        {"input_shape", r.input_shape},
                        {"output_shape", r.output_shape},
                        {"dtype", c10::toString(r.dtype)},
                        {"payload_bytes", r.payload_bytes},
                        {"peer", r.peer},
                        {"started_at_us", micros_since_epoch(r.started_at)},
                        {"description", describe(r)}};
    switch (r.state) {
      case FlightRecord::State::kCompleted:
        j["state"] = "completed";
        j["duration_ms"] = millis(*r.duration);
        break;
      case FlightRecord::State::kFailed:
        j["state"] = "failed";
        j["duration_ms"] = millis(*r.duration);
        break;
      case FlightRecord::State::kPending:
        j["state"] = "pending";
        j["pending_ms"] = millis(now_steady - r.started_steady);
        break;
    }
    records.push_back(std::move(j));
  }
  const nlohmann::json doc = {{"rank", log::rank()},
                              {"pid", static_cast<int64_t>(::getpid())},
                              {"reason", reason},
                              {"dumped_at_us", micros_since_epoch(std::chrono::system_clock::now())},
                              {"capacity", capacity()},
                              {"records", std::move(records)}};
  return doc.dump(1) + "\n";
}

void FlightRecorder::set_dump_file(std::filesystem::path path) {
  std::lock_guard<std::mutex> lock(mutex_);
  dump_file_ = std::move(path);
}

std::filesystem::path FlightRecorder::dump_file() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dump_file_;
}

bool FlightRecorder::dump_to_file(const std::string& reason) {
  std::filesystem::path path;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (dumped_ || dump_file_.empty()) return false;
    dumped_ = true;
    path = dump_file_;
  }
  try {
    const std::string text = to_json(reason);
    std::error_code ec;
    std::filesystem::create_directories(path.parent_path(), ec);
    const std::filesystem::path tmp = path.string() + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out << text;
      if (!out) return false;
    }
    std::filesystem::rename(tmp, path, ec);
    return !ec;
  } catch (const std::exception&) {
    return false;  // the process is failing already: its error line matters more than the dump
  }
}

FlightRecorder& flight_recorder() {
  // Never destroyed: a watchdog thread or a backend's completion callback may still use it while
  // static objects are torn down at exit.
  static FlightRecorder* recorder = new FlightRecorder();
  return *recorder;
}

// ---------------------------------------------------------------------------------------------
// Comm

struct Comm::Issue {
  CommOp op;
  int64_t payload_bytes = 0;
  ByteCount wire_bytes;
  std::vector<int64_t> input_shape;
  std::vector<int64_t> output_shape;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int peer = -1;
};

Comm::Comm(c10::intrusive_ptr<c10d::Backend> backend, std::string name,
           std::vector<int> world_ranks, int rank,
           c10::intrusive_ptr<c10d::Backend> device_backend, c10::Device device,
           std::shared_ptr<SharedMemoryCollectives> shared_memory, bool stage_device_tensors)
    : backend_(std::move(backend)),
      device_backend_(std::move(device_backend)),
      device_(device),
      shared_memory_(std::move(shared_memory)),
      stage_device_tensors_(stage_device_tensors),
      name_(std::move(name)),
      world_ranks_(std::move(world_ranks)),
      rank_(rank) {
  TORCH_CHECK(!world_ranks_.empty() && rank_ >= 0 && rank_ < size(),
              "Comm '", name_, "': rank ", rank_, " outside group of ", world_ranks_.size());
  TORCH_CHECK(size() == 1 || backend_, "Comm '", name_, "' of ", size(), " ranks needs a backend");
  for (const auto* b : {&backend_, &device_backend_}) {
    TORCH_CHECK(!*b || ((*b)->getSize() == size() && (*b)->getRank() == rank_),
                "Comm '", name_, "': backend is rank ", (*b)->getRank(), " of ",
                (*b)->getSize(), " but the group is rank ", rank_, " of ", size());
  }
  TORCH_CHECK(!device_backend_ || !device_.is_cpu(), "Comm '", name_,
              "': a device backend needs a non-CPU device (CPU tensors use the host backend)");
}

std::shared_ptr<Comm> Comm::single(std::string name, int world_rank) {
  return std::make_shared<Comm>(c10::intrusive_ptr<c10d::Backend>(), std::move(name),
                                std::vector<int>{world_rank}, 0);
}

int Comm::world_rank_of(int group_rank) const {
  LOOM_REQUIRE(group_rank >= 0 && group_rank < size(), "group rank ", group_rank,
               " is outside group ", describe());
  return world_ranks_[group_rank];
}

int Comm::group_rank_of(int world_rank) const {
  auto it = std::find(world_ranks_.begin(), world_ranks_.end(), world_rank);
  LOOM_REQUIRE(it != world_ranks_.end(), "world rank ", world_rank, " is not a member of group ",
               describe());
  return static_cast<int>(it - world_ranks_.begin());
}

std::string Comm::describe() const {
  std::string s = name_ + "[";
  for (size_t i = 0; i < world_ranks_.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(world_ranks_[i]);
  }
  return s + "]";
}

const c10::intrusive_ptr<c10d::Backend>& Comm::backend_for(const at::Tensor& tensor) const {
  LOOM_REQUIRE(size() > 1, "group ", describe(), " has one rank: its collectives are local and "
               "need no backend");
  if (tensor.is_cpu()) return backend_;
  LOOM_REQUIRE(device_backend_ && tensor.device() == device_, "collective on group ", describe(),
               ": a tensor on ", tensor.device(), " but this group serves the CPU",
               device_backend_ ? " and " + device_.str() : std::string(),
               "; move it to this rank's device (training.device)");
  return device_backend_;
}

c10d::Backend* Comm::routed(const at::Tensor& tensor) const {
  return size() == 1 ? nullptr : backend_for(tensor).get();
}

SharedMemoryCollectives* Comm::shared_memory_for(const at::Tensor& tensor) const {
  return size() > 1 && tensor.is_cpu() ? shared_memory_.get() : nullptr;
}

bool Comm::stages(const at::Tensor& tensor) const {
  return stage_device_tensors_ && size() > 1 && !tensor.is_cpu();
}

WorkHandle Comm::staged(CommOp op, WorkHandle host_work, std::function<void()> copy_back) {
  // The host collective is recorded and counted as itself; this work only copies the result back
  // to the device when it completes (not recorded again: record seq 0, no wait accounting).
  return c10::make_intrusive<CommWork>(rank_, op, std::move(host_work), std::move(copy_back), FlightRecord{});
}

void Comm::check_peer(int peer, const char* what) const {
  LOOM_REQUIRE(peer >= 0 && peer < size(), what, " ", peer, " is outside group ", describe(),
               " of ", size(), " ranks");
}

WorkHandle Comm::launch(Issue issue, c10d::Backend* backend,
                        const std::function<WorkHandle(c10d::Backend&)>& run,
                        std::function<void()> finalize) {
  if (size() == 1) {
    if (finalize) finalize();
    return CommWork::completed(rank_, issue.op);
  }
  comm_stats().record(issue.op, name_, issue.payload_bytes, issue.wire_bytes);
  FlightRecord record;
  record.group_seq = ++group_seq_;
  record.op = issue.op;
  record.group = describe();
  record.input_shape = std::move(issue.input_shape);
  record.output_shape = std::move(issue.output_shape);
  record.dtype = issue.dtype;
  record.payload_bytes = issue.payload_bytes;
  record.peer = issue.peer;
  record.started_at = std::chrono::system_clock::now();
  record.started_steady = std::chrono::steady_clock::now();
  FlightRecord identity = record;
  identity.seq = flight_recorder().start(std::move(record));
  const uint64_t seq = identity.seq;
  WorkHandle inner;
  try {
    inner = run(*backend);
  } catch (const c10::Error& e) {
    flight_recorder().finish(seq, false);
    fail(distributed::describe(identity), " could not be issued on group rank ", rank_, ": ",
         e.what_without_backtrace());
  } catch (...) {
    flight_recorder().finish(seq, false);
    throw;
  }
  // Close the record when the backend finishes, not only when the caller waits: the watchdog must
  // not take a finished-but-unwaited async collective for a stalled one. Gloo's send/recv works
  // have no future (their completion is only observable through wait()).
  const bool has_future = !(backend->getBackendName() == "gloo" &&
                            (issue.op == CommOp::kSend || issue.op == CommOp::kRecv));
  if (inner && has_future) {
    inner->getFuture()->addCallback([seq](c10::ivalue::Future& future) {
      flight_recorder().finish(seq, !future.hasError());
    });
  }
  const bool host_threads = backend->getBackendName() == "gloo";
  return c10::make_intrusive<CommWork>(rank_, issue.op, std::move(inner), std::move(finalize),
                                       std::move(identity), name_, host_threads);
}

WorkHandle Comm::all_reduce_async(const at::Tensor& tensor, ReduceOp op) {
  require_dense(tensor, "all_reduce", "the");
  require_avg_dtype(tensor, op, "all_reduce");
  if (stages(tensor)) {
    const at::Tensor host = tensor.to(at::kCPU);
    return staged(CommOp::kAllReduce, all_reduce_async(host, op), [tensor, host] { tensor.copy_(host); });
  }
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  Issue issue{CommOp::kAllReduce, bytes, ring_wire_bytes(CommOp::kAllReduce, bytes, size()),
              tensor.sizes().vec(), tensor.sizes().vec(), tensor.scalar_type()};
  if (SharedMemoryCollectives* shm = shared_memory_for(tensor)) {
    return launch(std::move(issue), routed(tensor),
                  [&](c10d::Backend&) { return shm->all_reduce(tensor, op); }, nullptr);
  }
  return launch(std::move(issue), routed(tensor), [&](c10d::Backend& backend) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    return backend.allreduce(tensors, opts);
  }, nullptr);
}

WorkHandle Comm::all_gather_into_tensor_async(const at::Tensor& output, const at::Tensor& input) {
  require_dense(output, "all_gather_into_tensor", "output");
  require_dense(input, "all_gather_into_tensor", "input");
  require_same_dtype(output, input, "all_gather_into_tensor");
  require_same_device(output, input, "all_gather_into_tensor");
  LOOM_REQUIRE(output.numel() == input.numel() * size(), "all_gather_into_tensor on ", describe(),
               ": output has ", output.numel(), " elements, expected ", size(), " x ",
               input.numel());
  if (stages(input)) {
    const at::Tensor host_out = at::empty(output.sizes(), output.options().device(at::kCPU));
    return staged(CommOp::kAllGather, all_gather_into_tensor_async(host_out, input.to(at::kCPU)),
                  [output, host_out] { output.copy_(host_out); });
  }
  const int64_t bytes = static_cast<int64_t>(output.nbytes());
  Issue issue{CommOp::kAllGather, bytes, ring_wire_bytes(CommOp::kAllGather, bytes, size()),
              input.sizes().vec(), output.sizes().vec(), input.scalar_type()};
  // Flat views: the backend splits the output along dim 0 into one chunk per rank.
  at::Tensor flat_out = output.view({-1});
  at::Tensor flat_in = input.view({-1});
  std::function<void()> finalize;
  if (size() == 1) finalize = [flat_out, flat_in] { flat_out.copy_(flat_in); };
  if (SharedMemoryCollectives* shm = shared_memory_for(input)) {
    return launch(std::move(issue), routed(input),
                  [&](c10d::Backend&) { return shm->all_gather(flat_out, flat_in); }, nullptr);
  }
  return launch(std::move(issue), routed(input), [&](c10d::Backend& backend) {
    return backend._allgather_base(flat_out, flat_in);
  }, std::move(finalize));
}

WorkHandle Comm::reduce_scatter_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                             ReduceOp op) {
  require_dense(output, "reduce_scatter_tensor", "output");
  require_dense(input, "reduce_scatter_tensor", "input");
  require_same_dtype(output, input, "reduce_scatter_tensor");
  require_same_device(output, input, "reduce_scatter_tensor");
  require_avg_dtype(input, op, "reduce_scatter_tensor");
  LOOM_REQUIRE(input.numel() == output.numel() * size(), "reduce_scatter_tensor on ", describe(),
               ": input has ", input.numel(), " elements, expected ", size(), " x ",
               output.numel());
  if (stages(input)) {
    const at::Tensor host_out = at::empty(output.sizes(), output.options().device(at::kCPU));
    return staged(CommOp::kReduceScatter, reduce_scatter_tensor_async(host_out, input.to(at::kCPU), op),
                  [output, host_out] { output.copy_(host_out); });
  }
  const int64_t bytes = static_cast<int64_t>(input.nbytes());
  Issue issue{CommOp::kReduceScatter, bytes,
              ring_wire_bytes(CommOp::kReduceScatter, bytes, size()), input.sizes().vec(),
              output.sizes().vec(), input.scalar_type()};
  at::Tensor flat_out = output.view({-1});
  at::Tensor flat_in = input.view({-1});
  if (size() == 1) {
    return launch(std::move(issue), nullptr, nullptr,
                  [flat_out, flat_in] { flat_out.copy_(flat_in); });
  }
  c10d::Backend* backend = routed(input);
  if (SharedMemoryCollectives* shm = shared_memory_for(input)) {
    return launch(std::move(issue), backend,
                  [&](c10d::Backend&) { return shm->reduce_scatter(flat_out, flat_in, op); }, nullptr);
  }
  if (backend->getBackendName() != "gloo") {  // NCCL reduce-scatters natively
    return launch(std::move(issue), backend, [&](c10d::Backend& b) {
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = to_c10d(op);
      return b._reduce_scatter_base(flat_out, flat_in, opts);
    }, nullptr);
  }
  // Gloo has no native reduce-scatter: its _reduce_scatter_base all-reduces a clone of the input
  // (a ring: every rank sends and reduces 2 (W - 1) / W of the tensor) and returns a work whose
  // isCompleted() stays false even after wait() (torch 2.13), which breaks polling. Loom instead
  // exchanges the chunks directly -- one all-to-all sends each rank the W copies of its chunk,
  // (W - 1) / W of the tensor per rank, half the ring's traffic -- and sums them in rank order on
  // completion. On one host's loopback that is 2.5x less time and CPU at 4 ranks (docs/profiling.md),
  // and the order of the sum no longer depends on the ring's position.
  // The scratch is a communication buffer in memory accounting (core/memory.h): counted from here
  // to the completion, and invisible to the allocator hook, since Gloo's threads may free it.
  at::Tensor scratch;
  {
    memory::UntrackedAllocationScope untracked;
    scratch = at::empty_like(flat_in);
  }
  const int64_t scratch_bytes = static_cast<int64_t>(scratch.nbytes());
  memory::note_comm_buffer_bytes(scratch.device(), scratch_bytes);
  const int64_t ranks = size();
  return launch(std::move(issue), backend, [&](c10d::Backend& b) {
    std::vector<int64_t> equal_splits;  // empty: W equal chunks along dim 0
    c10d::AllToAllOptions opts;
    return b.alltoall_base(scratch, flat_in, equal_splits, equal_splits, opts);
  }, [flat_out, scratch, ranks, op, scratch_bytes] {
    // Row r of the scratch is rank r's copy of this rank's chunk.
    const at::Tensor copies = scratch.view({ranks, -1});
    at::Tensor out = flat_out;  // a handle: the lambda's copy is const
    switch (op) {
      case ReduceOp::kSum: at::sum_out(out, copies, {0}); break;
      case ReduceOp::kAvg: at::sum_out(out, copies, {0}); out.div_(ranks); break;
      case ReduceOp::kMax: at::amax_out(out, copies, {0}); break;
    }
    memory::note_comm_buffer_bytes(scratch.device(), -scratch_bytes);
  });
}

WorkHandle Comm::broadcast_async(const at::Tensor& tensor, int root) {
  require_dense(tensor, "broadcast", "the");
  check_peer(root, "broadcast root");
  if (stages(tensor)) {
    const at::Tensor host = tensor.to(at::kCPU);
    return staged(CommOp::kBroadcast, broadcast_async(host, root), [tensor, host] { tensor.copy_(host); });
  }
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  Issue issue{CommOp::kBroadcast, bytes, ring_wire_bytes(CommOp::kBroadcast, bytes, size()),
              tensor.sizes().vec(), tensor.sizes().vec(), tensor.scalar_type(), root};
  return launch(std::move(issue), routed(tensor), [&](c10d::Backend& backend) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    return backend.broadcast(tensors, opts);
  }, nullptr);
}

WorkHandle Comm::all_to_all_async(const at::Tensor& output, const at::Tensor& input,
                                  std::vector<int64_t> output_split_sizes,
                                  std::vector<int64_t> input_split_sizes) {
  require_dense(output, "all_to_all", "output");
  require_dense(input, "all_to_all", "input");
  require_same_dtype(output, input, "all_to_all");
  require_same_device(output, input, "all_to_all");
  LOOM_REQUIRE(input.dim() >= 1 && output.dim() >= 1,
               "all_to_all needs tensors with at least one dimension (splits count dim-0 rows)");
  LOOM_REQUIRE(input.sizes().slice(1) == output.sizes().slice(1), "all_to_all on ", describe(),
               ": input rows ", input.sizes().slice(1), " and output rows ",
               output.sizes().slice(1), " differ in shape");
  if (stages(input)) {
    const at::Tensor host_out = at::empty(output.sizes(), output.options().device(at::kCPU));
    return staged(CommOp::kAllToAll,
                  all_to_all_async(host_out, input.to(at::kCPU), std::move(output_split_sizes),
                                   std::move(input_split_sizes)),
                  [output, host_out] { output.copy_(host_out); });
  }
  auto check_splits = [&](const std::vector<int64_t>& splits, const at::Tensor& t,
                          const char* which) {
    if (splits.empty()) {
      LOOM_REQUIRE(t.size(0) % size() == 0, "all_to_all on ", describe(), ": ", which, " has ",
                   t.size(0), " rows, not divisible by the group size ", size(),
                   "; pass explicit split sizes");
      return;
    }
    LOOM_REQUIRE(static_cast<int>(splits.size()) == size(), "all_to_all on ", describe(), ": ",
                 which, " split sizes have ", splits.size(), " entries, expected ", size());
    int64_t sum = 0;
    for (int64_t s : splits) {
      LOOM_REQUIRE(s >= 0, "all_to_all: negative ", which, " split size ", s);
      sum += s;
    }
    LOOM_REQUIRE(sum == t.size(0), "all_to_all on ", describe(), ": ", which,
                 " split sizes sum to ", sum, " but the tensor has ", t.size(0), " rows");
  };
  check_splits(input_split_sizes, input, "input");
  check_splits(output_split_sizes, output, "output");
  const int64_t row_bytes = input.size(0) == 0 ? 0 : input.nbytes() / input.size(0);
  const int64_t bytes = static_cast<int64_t>(input.nbytes());
  const int64_t local_rows =
      input_split_sizes.empty() ? input.size(0) / size() : input_split_sizes[rank_];
  // Exact bytes leaving this rank: everything except the chunk it keeps.
  const ByteCount wire = size() == 1 ? ByteCount{} : ByteCount::exact(bytes - local_rows * row_bytes);
  Issue issue{CommOp::kAllToAll, bytes, wire, input.sizes().vec(), output.sizes().vec(),
              input.scalar_type()};
  std::function<void()> finalize;
  if (size() == 1) {
    LOOM_REQUIRE(output.numel() == input.numel(), "all_to_all on ", describe(),
                 ": output has ", output.numel(), " elements, input ", input.numel());
    finalize = [output, input] { output.copy_(input); };
  }
  return launch(std::move(issue), routed(input), [&](c10d::Backend& backend) {
    at::Tensor out = output;
    at::Tensor in = input;
    return backend.alltoall_base(out, in, output_split_sizes, input_split_sizes);
  }, std::move(finalize));
}

WorkHandle Comm::send_async(const at::Tensor& tensor, int dst, int tag) {
  require_dense(tensor, "send", "the");
  check_peer(dst, "send destination");
  LOOM_REQUIRE(dst != rank_, "send on ", describe(), ": rank ", rank_, " cannot send to itself");
  if (stages(tensor)) {
    const at::Tensor host = tensor.to(at::kCPU);
    return staged(CommOp::kSend, send_async(host, dst, tag), [host] {});  // keeps `host` alive until sent
  }
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  Issue issue{CommOp::kSend, bytes, ring_wire_bytes(CommOp::kSend, bytes, size()),
              tensor.sizes().vec(), {}, tensor.scalar_type(), dst};
  return launch(std::move(issue), routed(tensor), [&](c10d::Backend& backend) {
    std::vector<at::Tensor> tensors{tensor};
    return backend.send(tensors, dst, tag);
  }, nullptr);
}

WorkHandle Comm::recv_async(const at::Tensor& tensor, int src, int tag) {
  require_dense(tensor, "recv", "the");
  check_peer(src, "recv source");
  LOOM_REQUIRE(src != rank_, "recv on ", describe(), ": rank ", rank_,
               " cannot receive from itself");
  if (stages(tensor)) {
    const at::Tensor host = at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
    return staged(CommOp::kRecv, recv_async(host, src, tag), [tensor, host] { tensor.copy_(host); });
  }
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  Issue issue{CommOp::kRecv, bytes, ring_wire_bytes(CommOp::kRecv, bytes, size()), {},
              tensor.sizes().vec(), tensor.scalar_type(), src};
  return launch(std::move(issue), routed(tensor), [&](c10d::Backend& backend) {
    std::vector<at::Tensor> tensors{tensor};
    return backend.recv(tensors, src, tag);
  }, nullptr);
}

WorkHandle Comm::barrier_async() {
  Issue issue{CommOp::kBarrier};
  // On the host backend whatever the device: NCCL's barrier is an all-reduce on a device it has to
  // guess, and a barrier synchronises processes, not device streams.
  return launch(std::move(issue), size() == 1 ? nullptr : backend_.get(),
                [](c10d::Backend& backend) { return backend.barrier(); }, nullptr);
}

void Comm::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  all_reduce_async(tensor, op)->wait();
}
void Comm::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input) {
  all_gather_into_tensor_async(output, input)->wait();
}
void Comm::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  reduce_scatter_tensor_async(output, input, op)->wait();
}
void Comm::broadcast(const at::Tensor& tensor, int root) { broadcast_async(tensor, root)->wait(); }
void Comm::all_to_all(const at::Tensor& output, const at::Tensor& input,
                      std::vector<int64_t> output_split_sizes,
                      std::vector<int64_t> input_split_sizes) {
  all_to_all_async(output, input, std::move(output_split_sizes), std::move(input_split_sizes))
      ->wait();
}
void Comm::send(const at::Tensor& tensor, int dst, int tag) { send_async(tensor, dst, tag)->wait(); }
void Comm::recv(const at::Tensor& tensor, int src, int tag) { recv_async(tensor, src, tag)->wait(); }
void Comm::barrier() { barrier_async()->wait(); }

void RingStep::wait_recv() {
  if (recv) recv->wait();
  recv.reset();
}

void RingStep::wait_send() {
  if (send) send->wait();
  send.reset();
}

RingStep ring_step(Comm& comm, const at::Tensor& to_send, const at::Tensor& to_recv, int tag) {
  const int t = comm.size(), r = comm.rank();
  const int next = (r + 1) % t, prev = (r + t - 1) % t;
  RingStep step;
  auto post_send = [&] {
    if (to_send.defined()) step.send = comm.send_async(to_send, next, tag);
  };
  auto post_recv = [&] {
    if (to_recv.defined()) step.recv = comm.recv_async(to_recv, prev, tag);
  };
  if (r % 2 == 0) {
    post_send();
    post_recv();
  } else {
    post_recv();
    post_send();
  }
  return step;
}

void set_collectives_interruptible(bool on) { interrupt_state().interruptible.store(on); }

void interrupt_collectives(const std::string& reason) {
  auto& s = interrupt_state();
  std::vector<std::function<void()>> wakers;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.interrupted.load()) s.reason = reason;
    s.interrupted.store(true);
    for (auto& [id, waker] : s.wakers) wakers.push_back(waker);
  }
  s.cv.notify_all();
  for (auto& waker : wakers) {
    try {
      waker();
    } catch (const std::exception&) {
    }
  }
}

void clear_collectives_interrupt() {
  auto& s = interrupt_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.interrupted.store(false);
  s.reason.clear();
}

bool collectives_interrupted() { return interrupt_state().interrupted.load(); }

}  // namespace loom::distributed
