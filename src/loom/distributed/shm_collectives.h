// Collectives between the ranks of one host through shared memory, for CPU tensors.
//
// Gloo moves CPU tensors between the ranks of one host over TCP loopback: every byte is copied
// into the kernel and out again, and a ring all-gather makes W - 1 such hops, which on a 2-core
// host with 4 ranks costs each rank ~25-30 ms of CPU per 25 MB all-gather (docs/profiling.md).
// Here every rank owns one shared segment (a header page and a data region that grows to the
// largest collective seen); an operation is one round:
//   1. wait until every peer has finished reading this rank's previous operation,
//   2. copy this rank's contribution into its own segment and post the operation's number,
//   3. read what it needs straight from each peer's segment (the all-gather's shards, the
//      reduce-scatter's chunk from every copy, the whole tensor for an all-reduce), reducing in
//      rank order, and post that it has finished.
// So a 25 MB all-gather costs a rank one copy of its shard and one of the gathered tensor, the
// same memcpy an NCCL SHM transport does, and sums are in rank order (deterministic, the same on
// every rank). Operations run in issue order on one worker thread per group, so they overlap
// compute like Gloo's. Ranks wait on a futex in the peer's header (a process-shared futex: no
// spinning, which would steal the core from the rank being waited for when ranks outnumber cores).
//
// Segments are created under unique names, opened by every member through the group's store,
// and unlinked as soon as all have opened them: a crash leaves nothing in /dev/shm (except one
// during the set-up itself).
// A rank that fails (timeout, a peer that gave up) marks its header failed; its peers' waits end
// with an error instead of hanging, and every later operation on the group fails.
//
// No room to grow (a /dev/shm too small for a collective, which set-up cannot foresee: segments
// grow to the largest collective met) is not a failure: the rank that cannot grow posts, instead
// of its contribution, the number of the operation from which it moves to Gloo. No peer can finish
// that operation without its contribution, so every member meets the flag at the same operation;
// each then creates the group's fallback Gloo backend (a collective of the members, from the
// worker thread) and runs that operation and every later one there, in issue order. The fallback
// backend is the group's own (not the Gloo backend the caller's other collectives use), so its
// order cannot interleave differently on different ranks. Reduce-scatters exchange chunks by
// all-to-all and sum in rank order, as here, so the sums do not change.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom/distributed/comm.h"

namespace loom::distributed {

class SharedMemoryCollectives {
 public:
  // Collective over the group: every member calls it with its group rank, the same `size` (at
  // least 2), and a store private to the group. `timeout` bounds each wait for a peer. Null, on
  // every member alike, when any member could not create or open a segment (the reason is logged
  // once per rank): the group's CPU collectives then stay on Gloo.
  // `make_fallback` makes the group's Gloo backend for the operations after a member ran out of
  // room (called at most once, on the worker thread, by every member at the same operation).
  using BackendFactory = std::function<c10::intrusive_ptr<c10d::Backend>()>;
  static std::unique_ptr<SharedMemoryCollectives> create(const c10::intrusive_ptr<c10d::Store>& store,
                                                         int rank, int size,
                                                         std::chrono::milliseconds timeout,
                                                         BackendFactory make_fallback);
  ~SharedMemoryCollectives();
  SharedMemoryCollectives(const SharedMemoryCollectives&) = delete;
  SharedMemoryCollectives& operator=(const SharedMemoryCollectives&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  void set_timeout(std::chrono::milliseconds timeout);

  // Same contracts as Comm's (contiguous CPU tensors, sizes checked by the caller); the work
  // completes on the group's worker thread. Tensors must stay alive and untouched until then.
  WorkHandle all_gather(at::Tensor output, at::Tensor input);
  WorkHandle reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op);
  WorkHandle all_reduce(at::Tensor tensor, ReduceOp op);

  // Bytes of this rank's segment now (header and data): shared memory outside the tensor
  // allocator, for logs and tests.
  int64_t segment_bytes() const;
  // The operation (1-based, in issue order) from which the group runs on its fallback Gloo
  // backend; 0 while it runs on shared memory.
  uint32_t on_gloo_since() const { return on_gloo_since_.load(); }

 private:
  struct Segment;
  struct Job;
  class Work;

  SharedMemoryCollectives(int rank, int size, std::chrono::milliseconds timeout, BackendFactory make_fallback);
  WorkHandle enqueue(std::shared_ptr<Job> job);
  void worker_loop();
  void run(const Job& job);
  // Waits until `ready()` holds, sleeping on peer `peer`'s futex word; loom::Error on a peer that
  // failed, a shutdown, or the timeout (naming `what` the peer did not do, and collective `op`).
  void wait_for(int peer, const std::function<bool()>& ready, const char* what, uint32_t op);
  void ring_own_bell();
  void mark_failed();
  // Grows this rank's data region to hold `bytes`; false (with `problem` said) when the shared
  // memory has no room.
  bool ensure_own_capacity(int64_t bytes, std::string& problem);
  // Moves the group to its fallback backend from operation `op` on and runs `job` there.
  void run_on_gloo(const Job& job);
  void move_to_gloo(uint32_t op, const std::string& reason);
  const char* peer_data(int peer, int64_t bytes);  // remaps a peer's grown segment when needed

  int rank_;
  int size_;
  std::vector<std::unique_ptr<Segment>> segments_;  // [group rank]; this rank's own one too

  mutable std::mutex mutex_;  // guards queue_, stop_, failed_, timeout_
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  std::atomic<bool> stopping_{false};  // stop_, readable without the lock while waiting for peers
  std::string failed_;  // the first failure: later operations fail with it
  std::chrono::milliseconds timeout_;
  uint32_t next_op_ = 0;  // worker thread only
  BackendFactory make_fallback_;
  c10::intrusive_ptr<c10d::Backend> fallback_;  // worker thread only (its timeout: under mutex_)
  std::atomic<uint32_t> on_gloo_since_{0};
  std::thread worker_;
};

}  // namespace loom::distributed
