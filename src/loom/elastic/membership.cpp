#include "loom/elastic/membership.h"

#include <c10/util/StringUtil.h>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/distributed/comm.h"
#include "loom/distributed/elastic_protocol.h"

namespace loom::elastic {

namespace {
std::string get_string(c10d::Store& store, const std::string& key) {
  const std::vector<uint8_t> v = store.get(key);
  return std::string(v.begin(), v.end());
}
void set_string(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}
constexpr std::chrono::milliseconds kPoll{20};
}  // namespace

namespace {

class InterruptiblePrefixStore : public c10d::PrefixStore {
 public:
  InterruptiblePrefixStore(std::string prefix, c10::intrusive_ptr<c10d::Store> store)
      : c10d::PrefixStore(prefix, std::move(store)), prefix_(std::move(prefix)) {}

  std::vector<uint8_t> get(const std::string& key) override {
    await({key}, getTimeout());
    return c10d::PrefixStore::get(key);
  }
  void wait(const std::vector<std::string>& keys) override { await(keys, getTimeout()); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    await(keys, timeout);
  }
  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<InterruptiblePrefixStore>(prefix_, getUnderlyingStore()->clone());
  }

 private:
  void await(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::chrono::microseconds nap(100);
    while (!check(keys)) {
      if (distributed::collectives_interrupted()) {
        throw distributed::CollectivesInterrupted("rendezvous abandoned: the membership changed");
      }
      LOOM_REQUIRE(std::chrono::steady_clock::now() < deadline, "rendezvous: wait timeout after ",
                   timeout.count(), " ms for ", keys.front());
      std::this_thread::sleep_for(nap);
      nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(10));
    }
  }
  std::string prefix_;
};

}  // namespace

c10::intrusive_ptr<c10d::Store> interruptible_prefix_store(const std::string& prefix,
                                                           c10::intrusive_ptr<c10d::Store> store) {
  return c10::make_intrusive<InterruptiblePrefixStore>(prefix, std::move(store));
}

MembershipClient::MembershipClient(c10::intrusive_ptr<c10d::Store> store, int64_t member)
    : store_(std::move(store)), member_(member) {}

MembershipClient::~MembershipClient() { stop_watch(); }

int64_t MembershipClient::newest() {
  if (!store_->check({distributed::kGenerationKey})) return -1;
  return std::stoll(get_string(*store_, distributed::kGenerationKey));
}

Generation MembershipClient::read(int64_t number) {
  const auto j = nlohmann::json::parse(get_string(*store_, c10::str(distributed::kGenerationKeyPrefix, number)));
  Generation g;
  g.number = number;
  g.members = j.at("members").get<std::vector<int64_t>>();
  if (j.contains("lost")) g.lost = j.at("lost").get<std::vector<int64_t>>();
  if (j.contains("joined")) g.joined = j.at("joined").get<std::vector<int64_t>>();
  if (j.contains("reason")) g.reason = j.at("reason").get<std::string>();
  return g;
}

Generation MembershipClient::wait_newer(int64_t after, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const int64_t n = newest();
    if (n > after) return read(n);
    if (done()) return Generation{};
    LOOM_REQUIRE(std::chrono::steady_clock::now() < deadline, "fault tolerance: member ", member_,
                 " waited ", timeout.count() / 1000, " s for a new membership after generation ", after,
                 " and none came (fault_tolerance.join_timeout_seconds); stopping");
    std::this_thread::sleep_for(kPoll);
  }
}

bool MembershipClient::assemble(const Generation& generation, std::chrono::milliseconds timeout) {
  const std::string prefix = c10::str("loom/elastic/here/", generation.number, "/");
  set_string(*store_, prefix + std::to_string(member_), "1");
  std::vector<std::string> keys;
  for (int64_t m : generation.members) keys.push_back(prefix + std::to_string(m));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (store_->check(keys)) return true;
    if (newest() > generation.number) return false;
    LOOM_REQUIRE(std::chrono::steady_clock::now() < deadline, "fault tolerance: generation ", generation.number,
                 " did not assemble within ", timeout.count() / 1000, " s (comm.timeout_seconds)");
    std::this_thread::sleep_for(kPoll);
  }
}

void MembershipClient::watch(int64_t current) {
  stop_watch();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
  }
  thread_ = std::thread([this, current] {
    c10::intrusive_ptr<c10d::Store> client;
    try {
      client = store_->clone();
    } catch (const std::exception& e) {
      log::warn("fault tolerance: cannot watch the membership (", e.what(), ")");
      return;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, kPoll);
      if (stop_) return;
      lock.unlock();
      int64_t n = -1;
      try {
        if (client->check({distributed::kGenerationKey})) n = std::stoll(get_string(*client, distributed::kGenerationKey));
      } catch (const std::exception&) {
        n = -1;  // the launcher is gone: its death ends this process too (PR_SET_PDEATHSIG)
      }
      if (n > current) {
        distributed::interrupt_collectives(c10::str("the membership changed (generation ", n, ")"));
        return;
      }
      lock.lock();
    }
  });
}

void MembershipClient::stop_watch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void MembershipClient::record_layout(int64_t generation, const GenerationLayout& layout) {
  const nlohmann::json j = {{"generation", generation},     {"trainers", layout.trainers},
                            {"spares", layout.spares},       {"dp_replicate", layout.dp_replicate},
                            {"dp_shard", layout.dp_shard},   {"local_batch_size", layout.local_batch_size}};
  set_string(*store_, "loom/elastic/trained_layout", j.dump());
}

GenerationLayout MembershipClient::trained_layout() {
  GenerationLayout layout;
  if (!store_->check({"loom/elastic/trained_layout"})) return layout;
  const auto j = nlohmann::json::parse(get_string(*store_, "loom/elastic/trained_layout"));
  layout.generation = j.at("generation").get<int64_t>();
  layout.trainers = j.at("trainers").get<std::vector<int64_t>>();
  layout.spares = j.at("spares").get<std::vector<int64_t>>();
  layout.dp_replicate = j.at("dp_replicate").get<int64_t>();
  layout.dp_shard = j.at("dp_shard").get<int64_t>();
  layout.local_batch_size = j.at("local_batch_size").get<int64_t>();
  return layout;
}

bool MembershipClient::join_requested(int64_t current) {
  if (!store_->check({distributed::kJoinRequestKey})) return false;
  return std::stoll(get_string(*store_, distributed::kJoinRequestKey)) == current;
}

void MembershipClient::yield(int64_t current, int64_t step) {
  set_string(*store_, c10::str(distributed::kYieldKeyPrefix, current), std::to_string(step));
}

void MembershipClient::set_ready() {
  set_string(*store_, c10::str(distributed::kReadyKeyPrefix, member_), "1");
}

void MembershipClient::set_done(int64_t step) {
  set_string(*store_, distributed::kDoneKey, std::to_string(step));
}

bool MembershipClient::done() { return store_->check({distributed::kDoneKey}); }

}  // namespace loom::elastic
