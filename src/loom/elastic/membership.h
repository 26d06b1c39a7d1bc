// A rank's side of the membership protocol (distributed/elastic_protocol.h): reading the
// generations `loom launch` writes, noticing a newer one while training (which interrupts the
// collectives in flight, distributed/comm.h), asking to stop at a step boundary for joiners.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom/elastic/generation.h"

namespace loom::elastic {

struct Generation {
  int64_t number = -1;
  std::vector<int64_t> members;
  std::vector<int64_t> lost;
  std::vector<int64_t> joined;
  std::string reason;
};

// A prefix store whose blocking reads (get, wait) give up with distributed::CollectivesInterrupted
// once collectives are interrupted (the membership changed): a membership's world forms through it,
// so a member lost while the others rendezvous ends the rendezvous at once, not at its timeout.
c10::intrusive_ptr<c10d::Store> interruptible_prefix_store(const std::string& prefix,
                                                           c10::intrusive_ptr<c10d::Store> store);

class MembershipClient {
 public:
  // `store`: the attempt's store (the prefix the launcher writes under).
  MembershipClient(c10::intrusive_ptr<c10d::Store> store, int64_t member);
  ~MembershipClient();  // stops the watch
  MembershipClient(const MembershipClient&) = delete;
  MembershipClient& operator=(const MembershipClient&) = delete;

  int64_t member() const { return member_; }
  // The newest generation number (-1 before the launcher wrote one).
  int64_t newest();
  Generation read(int64_t number);
  // Waits for a generation newer than `after`, or the end of training (nullopt-like: number -1 and
  // done() true). loom::Error after `timeout`.
  Generation wait_newer(int64_t after, std::chrono::milliseconds timeout);

  // Before forming generation `number`'s world: says this member is here and waits until every
  // member of it is, so a member that died before forming is met here (false: a newer generation
  // superseded this one) rather than as a rendezvous that waits out its timeout.
  bool assemble(const Generation& generation, std::chrono::milliseconds timeout);

  // While training in generation `current`: a thread polls for a newer one and, when it appears,
  // interrupts the collectives in flight (comm.h) naming the reason.
  void watch(int64_t current);
  void stop_watch();

  // The layout of the newest generation that trained (its state is the one the members hold):
  // written by its rank 0 once its trainer was built, read by every member when it plans the next,
  // so all plan from the same one. Empty trainers before any.
  void record_layout(int64_t generation, const GenerationLayout& layout);
  GenerationLayout trained_layout();

  // Whether the launcher asks generation `current` to stop at the next step boundary for joiners.
  bool join_requested(int64_t current);
  // Rank 0 of `current`, after stopping at the boundary after `step`.
  void yield(int64_t current, int64_t step);
  // A replacement that can take state now.
  void set_ready();
  // Rank 0 of the generation that finished training.
  void set_done(int64_t step);
  bool done();

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int64_t member_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = true;
  std::thread thread_;
};

}  // namespace loom::elastic
