// The one door every collective in Loom goes through. A Comm is a communication group serving one
// mesh dimension (or the world): a c10d backend plus the dimension's name and this rank's place in
// it. Besides issuing the collective it
//   - counts, per (op, mesh dim), the calls, payload bytes and ring-model wire bytes (CommStats),
//   - records the last N collectives of this process in a ring buffer (FlightRecorder), so a
//     watchdog can name the collective a stalled rank is stuck in.
// A group of one rank needs no backend: every collective is a local no-op/copy and nothing is
// counted or recorded, so single-process runs work without any network.
//
// Backends per device, as c10d's ProcessGroup keeps one per device type: the host backend (Gloo)
// serves CPU tensors and barriers (the trainer's loss and non-finite flags, checkpoint planning),
// and on a rank computing on an accelerator a device backend (NCCL on CUDA) serves the tensors on
// that device (FSDP's all-gathers and reduce-scatters, DDP's buckets, gradient norms). Each
// collective goes to the backend of its tensors' device; a CPU run has no device backend.
//
// Tensors must be contiguous; in-place collectives (all_reduce, broadcast, recv) write into the
// given tensor's storage.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.h"

namespace loom::distributed {

enum class ReduceOp { kSum, kAvg, kMax };
enum class CommOp { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kAllToAll, kSend, kRecv,
                    kBarrier };
const char* to_string(ReduceOp op);
const char* to_string(CommOp op);

// ---------------------------------------------------------------------------------------------
// Accounting

// An exact non-negative byte count numerator/denominator, kept in lowest terms: ring-model wire
// bytes such as 2(W-1)/W x size are not integers in general, and per-step totals must not drift.
struct ByteCount {
  int64_t numerator = 0;
  int64_t denominator = 1;

  static ByteCount exact(int64_t bytes) { return {bytes, 1}; }
  static ByteCount fraction(int64_t numerator, int64_t denominator);
  double value() const { return static_cast<double>(numerator) / static_cast<double>(denominator); }
  ByteCount& operator+=(const ByteCount& other);
  friend bool operator==(const ByteCount& a, const ByteCount& b) {
    return a.numerator == b.numerator && a.denominator == b.denominator;
  }
};

// Ring-model bytes one rank sends for a collective over `group_size` ranks, given its payload:
//   all_gather / reduce_scatter: (W-1)/W x full (gathered / pre-scatter) size
//   all_reduce:                  2(W-1)/W x size (a reduce-scatter followed by an all-gather)
//   all_to_all:                  (W-1)/W x input size (everything but the local chunk, even splits)
//   broadcast:                   size (pipelined chain: each rank forwards the tensor once)
//   send:                        size;  recv and barrier: 0 (the sending rank counts the bytes).
// Groups of one rank send nothing.
ByteCount ring_wire_bytes(CommOp op, int64_t payload_bytes, int group_size);

struct CommCounter {
  int64_t calls = 0;
  int64_t payload_bytes = 0;  // tensor bytes: the full tensor for all_gather / reduce_scatter
  ByteCount wire_bytes;       // ring model, see ring_wire_bytes
  // Exposed communication: host seconds the caller spent blocked in these collectives' wait()
  // (a synchronous collective waits for all of it; an async one only for what compute since its
  // issue did not hide). On CUDA a wait only orders streams, so this counts host-side waits
  // (Gloo's) and not what NCCL streams leave exposed on the device.
  double wait_seconds = 0;
  CommCounter& operator+=(const CommCounter& other);
};

struct CommSnapshot {
  // Keyed by (op, mesh dim name).
  std::map<std::pair<CommOp, std::string>, CommCounter> counters;

  CommCounter get(CommOp op, const std::string& dim) const;  // zeros when never issued
  CommCounter total() const;
  CommCounter total_for_dim(const std::string& dim) const;
  // One line per (op, dim): "all_gather@dp_shard calls=4 payload=1.50MiB wire=768.00KiB".
  std::string format() const;
};

// Process-wide counters; thread-safe. The trainer takes snapshot() and reset() once per step.
class CommStats {
 public:
  void record(CommOp op, const std::string& dim, int64_t payload_bytes, ByteCount wire_bytes);
  // Host seconds a caller blocked waiting for a collective (CommCounter::wait_seconds).
  void record_wait(CommOp op, const std::string& dim, double seconds);
  CommSnapshot snapshot() const;
  void reset();
  // Puts back counts taken by snapshot(): traffic since then is left out (validation's forward is
  // not a training step's communication).
  void restore(CommSnapshot snapshot);

 private:
  mutable std::mutex mutex_;
  CommSnapshot current_;
};
CommStats& comm_stats();

// ---------------------------------------------------------------------------------------------
// Flight recorder

inline constexpr size_t kDefaultFlightRecorderCapacity = 64;

struct FlightRecord {
  enum class State { kPending, kCompleted, kFailed };
  uint64_t seq = 0;        // process-wide issue order
  uint64_t group_seq = 0;  // n-th collective on its group: equal across the group's ranks
  CommOp op = CommOp::kBarrier;
  std::string group;       // "dp_shard[0,2]": mesh dim name and member world ranks
  std::vector<int64_t> input_shape;
  std::vector<int64_t> output_shape;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t payload_bytes = 0;
  int peer = -1;  // group rank of the root (broadcast) or peer (send/recv), else -1
  std::chrono::system_clock::time_point started_at;
  std::chrono::steady_clock::time_point started_steady;
  std::optional<std::chrono::steady_clock::duration> duration;  // set once finished
  State state = State::kPending;
};

// The collective's identity, as the flight recorder dump and error messages name it:
//   "all_reduce world[0,1] gseq=3 in=[4] out=[4] Float 16B"
std::string describe(const FlightRecord& record);

// Ring buffer of the last `capacity` collectives issued by this process; thread-safe.
class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity = kDefaultFlightRecorderCapacity);
  // Returns the record's seq, used to mark it finished.
  uint64_t start(FlightRecord record);
  // Marks a pending record completed or failed; the first call wins. The comm layer calls it when
  // the backend finishes the collective (where the backend reports that, e.g. Gloo's collectives;
  // Gloo send/recv only report it to wait()), else when the caller waits, so a collective whose
  // result is ready but not yet waited for does not count as pending.
  void finish(uint64_t seq, bool success);
  std::vector<FlightRecord> records() const;  // oldest first
  std::optional<FlightRecord> oldest_pending() const;
  // One line per record, oldest first, with the age of pending ones:
  //   "#12 all_gather dp_shard[0,2] gseq=3 in=[1024] out=[2048] Float 8.00KiB
  //    started 12:00:01.123 completed in 0.41 ms"
  std::string dump() const;
  void set_capacity(size_t capacity);
  size_t capacity() const;
  void clear();
  // Marks every pending record failed: the collectives of a membership that elastic training
  // abandoned (their peers are gone), which no watchdog must later take for stalls.
  void abandon_pending();

  // The ring as JSON, oldest first, for <dump_folder>/flight_recorder/rank<r>.json:
  //   {"rank": 0, "reason": "...", "dumped_at_us": ..., "records": [{"seq": 12, "group_seq": 3,
  //    "op": "all_gather", "group": "dp_shard[0,1]", "input_shape": [1024], "output_shape": [2048],
  //    "dtype": "Float", "payload_bytes": 8192, "peer": -1, "started_at_us": ..., "state":
  //    "pending", "pending_ms": 2040.1}, ...]}   (completed/failed records have "duration_ms")
  // `reason` says why it was dumped (the stall, the failed collective, the signal).
  std::string to_json(const std::string& reason) const;
  // Where dump_to_file writes; empty (the default) = nowhere. The trainer sets it for runs of more
  // than one rank.
  void set_dump_file(std::filesystem::path path);
  std::filesystem::path dump_file() const;
  // Writes to_json(reason) to dump_file(), once per process: the first reason (the root cause)
  // wins, later calls do nothing. Returns whether this call wrote it. Never throws: it runs on the
  // way out of a failing process.
  bool dump_to_file(const std::string& reason);

 private:
  mutable std::mutex mutex_;
  std::filesystem::path dump_file_;
  bool dumped_ = false;
  size_t capacity_;
  uint64_t next_seq_ = 1;
  std::deque<FlightRecord> ring_;
};
FlightRecorder& flight_recorder();

// Ending the waits of a membership that is gone (elastic training, src/loom/elastic/): when a rank
// dies, its peers may be blocked in a collective with it, or with a survivor that already left
// that collective to re-form. While collectives are interruptible, interrupt_collectives() ends
// every wait on a Comm collective, present and future, with CollectivesInterrupted (the backend's
// work is abandoned, never reused: its group is dropped with the membership) until
// clear_collectives_interrupt(). Off by default; waits then block exactly as before.
class CollectivesInterrupted : public Error {
 public:
  using Error::Error;
};
void set_collectives_interruptible(bool on);
void interrupt_collectives(const std::string& reason);
void clear_collectives_interrupt();
bool collectives_interrupted();

// ---------------------------------------------------------------------------------------------
// Comm

using WorkHandle = c10::intrusive_ptr<c10d::Work>;
class SharedMemoryCollectives;

class Comm {
 public:
  // `world_ranks`: the members' world ranks in group-rank order; `rank`: this process's group rank.
  // `backend` serves CPU tensors; `device_backend` (null on CPU runs) serves tensors on `device`.
  // `shared_memory` (null: none), for groups whose ranks share a host, takes over the all-gathers,
  // reduce-scatters and all-reduces of CPU tensors from `backend` (shm_collectives.h).
  // `stage_device_tensors` (comm.device_transport = "host"; then no device backend): a collective
  // on device tensors copies them to host memory, runs there (shared memory or `backend`) and
  // copies the result back when its work completes: ranks sharing one GPU can then communicate.
  Comm(c10::intrusive_ptr<c10d::Backend> backend, std::string name, std::vector<int> world_ranks,
       int rank, c10::intrusive_ptr<c10d::Backend> device_backend = {},
       c10::Device device = c10::Device(c10::kCPU),
       std::shared_ptr<SharedMemoryCollectives> shared_memory = {}, bool stage_device_tensors = false);
  // A group of just this process (world rank `world_rank`): no backend, no network.
  static std::shared_ptr<Comm> single(std::string name, int world_rank);

  const std::string& name() const { return name_; }
  int size() const { return static_cast<int>(world_ranks_.size()); }
  int rank() const { return rank_; }
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  int world_rank_of(int group_rank) const;
  int group_rank_of(int world_rank) const;  // throws when not a member
  // The host (CPU) backend.
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }
  // The backend for tensors on device(); null on CPU runs and in groups of one rank.
  const c10::intrusive_ptr<c10d::Backend>& device_backend() const { return device_backend_; }
  // The rank's compute device (the CPU on CPU runs).
  const c10::Device& device() const { return device_; }
  // Whether CPU all-gathers, reduce-scatters and all-reduces go through shared memory.
  bool uses_shared_memory() const { return shared_memory_ != nullptr; }
  // The shared-memory transport of this group's CPU collectives, or null.
  const SharedMemoryCollectives* shared_memory() const { return shared_memory_.get(); }
  // The backend a collective on `tensor` goes to: the host backend for CPU tensors, the device
  // backend for tensors on device(). loom::Error for any other device, or in a group of one rank
  // (it has no backend: its collectives are local).
  const c10::intrusive_ptr<c10d::Backend>& backend_for(const at::Tensor& tensor) const;
  std::string describe() const;  // "dp_shard[0,2]"

  // Collectives are non-const: each advances the group's sequence number (flight recorder).
  // In place: every rank ends with the reduction of all ranks' `tensor`. kAvg needs floating point.
  void all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // output (numel = size() x input numel) = concatenation of every rank's input, in rank order.
  void all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input);
  // output (numel = input numel / size()) = this rank's chunk of the reduction of all inputs.
  void reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                             ReduceOp op = ReduceOp::kSum);
  // In place: every rank ends with group rank `root`'s tensor.
  void broadcast(const at::Tensor& tensor, int root);
  // Rank r's input rows [offset_j, offset_j + input_split_sizes[j]) go to rank j, which places them
  // at its output rows for source r. Split sizes count dim-0 rows; empty = even split.
  void all_to_all(const at::Tensor& output, const at::Tensor& input,
                  std::vector<int64_t> output_split_sizes = {},
                  std::vector<int64_t> input_split_sizes = {});
  void send(const at::Tensor& tensor, int dst, int tag = 0);  // dst/src: group ranks
  void recv(const at::Tensor& tensor, int src, int tag = 0);
  void barrier();

  // Asynchronous variants: the collective is issued (counted and recorded) now; the returned work's
  // wait() blocks until the result is in place (including any post-processing such as the kAvg
  // division) and marks the flight record completed. Tensors must stay alive and untouched until then.
  WorkHandle all_reduce_async(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  WorkHandle all_gather_into_tensor_async(const at::Tensor& output, const at::Tensor& input);
  WorkHandle reduce_scatter_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                         ReduceOp op = ReduceOp::kSum);
  WorkHandle broadcast_async(const at::Tensor& tensor, int root);
  WorkHandle all_to_all_async(const at::Tensor& output, const at::Tensor& input,
                              std::vector<int64_t> output_split_sizes = {},
                              std::vector<int64_t> input_split_sizes = {});
  WorkHandle send_async(const at::Tensor& tensor, int dst, int tag = 0);
  WorkHandle recv_async(const at::Tensor& tensor, int src, int tag = 0);
  WorkHandle barrier_async();

 private:
  struct Issue;  // bookkeeping of one collective (defined in comm.cpp)
  // `backend`: the one `run` issues on (null in groups of one rank).
  WorkHandle launch(Issue issue, c10d::Backend* backend,
                    const std::function<WorkHandle(c10d::Backend&)>& run,
                    std::function<void()> finalize);
  c10d::Backend* routed(const at::Tensor& tensor) const;
  // The shared-memory transport for a collective on `tensor`, or null (Gloo or NCCL serves it).
  SharedMemoryCollectives* shared_memory_for(const at::Tensor& tensor) const;
  void check_peer(int peer, const char* what) const;
  // Whether a collective on `tensor` is staged through host memory (stage_device_tensors).
  bool stages(const at::Tensor& tensor) const;
  // The work of a staged collective: `host_work` (the collective on the host copies), then
  // `copy_back` (the result to the device tensors) when it completes.
  WorkHandle staged(CommOp op, WorkHandle host_work, std::function<void()> copy_back);

  c10::intrusive_ptr<c10d::Backend> backend_;
  c10::intrusive_ptr<c10d::Backend> device_backend_;
  c10::Device device_;
  std::shared_ptr<SharedMemoryCollectives> shared_memory_;
  bool stage_device_tensors_ = false;
  std::string name_;
  std::vector<int> world_ranks_;
  int rank_;
  uint64_t group_seq_ = 0;
};

// One step of a ring over `comm`: sends `to_send` to the next group rank and receives `to_recv`
// from the previous one (either may be undefined: no such transfer). On Gloo any posting order
// works; on NCCL a send and a receive between the same two ranks share one communicator and
// stream, so with two ranks both must not post their receive first. Even ranks post the send
// first, odd ranks the receive: every pair matches. Used by the collective matmuls of async TP and
// by ring attention.
struct RingStep {
  WorkHandle send, recv;
  void wait_recv();
  void wait_send();
  void wait() { wait_recv(), wait_send(); }
};
RingStep ring_step(Comm& comm, const at::Tensor& to_send, const at::Tensor& to_recv, int tag);

}  // namespace loom::distributed
