#include "loom/elastic/host_snapshot.h"

#include <c10/util/StringUtil.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "loom/core/error.h"

namespace loom::elastic {

namespace {

constexpr uint64_t kMagic = 0x4c4f4f4d534e4150ULL;  // "LOOMSNAP"
constexpr int64_t kHeaderBytes = 4096;
// The state's JSON (data loader cursor, step, LR schedule's settings), rewritten every step.
constexpr int64_t kJsonCapacity = int64_t{1} << 20;

struct SlotHeader {
  std::atomic<int64_t> step;  // -1 while being written
  int64_t generation;
  int64_t rank;
  int64_t meta_bytes;
  int64_t json_bytes;
  int64_t data_bytes;
};

struct Header {
  uint64_t magic;
  int64_t slot_bytes;     // bytes of one slot: meta capacity + data
  int64_t meta_capacity;
  std::atomic<int64_t> newest;  // the slot written last (0 or 1), -1: none
  SlotHeader slots[2];
};
static_assert(sizeof(Header) <= kHeaderBytes);

char* slot_base(void* base, int64_t slot, int64_t slot_bytes) {
  return static_cast<char*>(base) + kHeaderBytes + slot * slot_bytes;
}

}  // namespace

std::filesystem::path HostSnapshot::path_of(const std::string& job, int64_t member) {
  return std::filesystem::path("/dev/shm") / c10::str("loom-elastic-", job, "-member", member);
}

HostSnapshot::HostSnapshot(const std::string& job, int64_t member) : path_(path_of(job, member)) {}

HostSnapshot::~HostSnapshot() {
  if (base_ != nullptr) ::munmap(base_, static_cast<size_t>(size_));
  if (fd_ >= 0) ::close(fd_);
}

void HostSnapshot::map(int64_t slot_bytes, int64_t meta_capacity) {
  if (base_ != nullptr) ::munmap(base_, static_cast<size_t>(size_));
  if (fd_ < 0) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    LOOM_REQUIRE(fd_ >= 0, "fault tolerance: cannot create '", path_.string(), "': ", std::strerror(errno));
  }
  size_ = kHeaderBytes + 2 * slot_bytes;
  // Reserved now: a /dev/shm without room says so here, not as a SIGBUS at the first write.
  const int rc = ::posix_fallocate(fd_, 0, size_);
  LOOM_REQUIRE(rc == 0, "fault tolerance: no room for this rank's state copy in /dev/shm (", size_ >> 20,
               " MiB for '", path_.string(), "': ", std::strerror(rc),
               "); enlarge /dev/shm or set fault_tolerance.shard_copy = \"neighbour\"");
  base_ = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  LOOM_REQUIRE(base_ != MAP_FAILED, "fault tolerance: cannot map '", path_.string(), "': ", std::strerror(errno));
  auto* h = static_cast<Header*>(base_);
  h->magic = kMagic;
  h->slot_bytes = slot_bytes;
  h->meta_capacity = meta_capacity;
  h->newest.store(-1);
  for (auto& s : h->slots) s.step.store(-1);
  slot_bytes_ = slot_bytes;
  meta_capacity_ = meta_capacity;
}

void HostSnapshot::write(const checkpoint::ShardedStateDict& state, int64_t generation, int64_t rank,
                         int64_t step) {
  if (base_ == nullptr || generation != generation_) {
    // The pieces' layout is fixed for a membership: laid out once per membership (its ranks read
    // the previous one's copies while forming, before the first write).
    generation_ = generation;
    meta_ = describe_pieces(state);
    meta_text_ = meta_.dump();
    const int64_t meta_capacity = static_cast<int64_t>(meta_text_.size() + 4095) / 4096 * 4096;
    map(meta_capacity + kJsonCapacity + (pieces_bytes(meta_) + 4095) / 4096 * 4096, meta_capacity);
  }
  auto* h = static_cast<Header*>(base_);
  const int64_t slot = h->newest.load() == 0 ? 1 : 0;
  SlotHeader& s = h->slots[slot];
  s.step.store(-1);  // being written: not a copy anyone may read
  char* at = slot_base(base_, slot, slot_bytes_);
  std::memcpy(at, meta_text_.data(), meta_text_.size());
  const nlohmann::json json = {{"json", state.json()}, {"rank_json", state.rank_json()}};
  const std::string json_text = json.dump();
  LOOM_REQUIRE(static_cast<int64_t>(json_text.size()) <= kJsonCapacity, "fault tolerance: the training state's JSON (",
               json_text.size(), " bytes) outgrew its room in the host copy");
  std::memcpy(at + meta_capacity_, json_text.data(), json_text.size());
  torch::Tensor data = torch::from_blob(at + meta_capacity_ + kJsonCapacity, {pieces_bytes(meta_)}, torch::kUInt8);
  copy_pieces(state, meta_, data);
  s.generation = generation;
  s.rank = rank;
  s.meta_bytes = static_cast<int64_t>(meta_text_.size());
  s.json_bytes = static_cast<int64_t>(json_text.size());
  s.data_bytes = data.numel();
  s.step.store(step, std::memory_order_release);
  h->newest.store(slot, std::memory_order_release);
}

namespace {
struct Mapped {
  int fd = -1;
  void* base = MAP_FAILED;
  size_t size = 0;
  ~Mapped() {
    if (base != MAP_FAILED) ::munmap(base, size);
    if (fd >= 0) ::close(fd);
  }
};

bool map_read(const std::filesystem::path& file, Mapped& m) {
  m.fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (m.fd < 0) return false;
  const off_t size = ::lseek(m.fd, 0, SEEK_END);
  if (size < kHeaderBytes) return false;
  m.size = static_cast<size_t>(size);
  m.base = ::mmap(nullptr, m.size, PROT_READ, MAP_SHARED, m.fd, 0);
  return m.base != MAP_FAILED && static_cast<const Header*>(m.base)->magic == kMagic;
}
}  // namespace

std::vector<SnapshotSlot> read_snapshot_slots(const std::filesystem::path& file) {
  Mapped m;
  std::vector<SnapshotSlot> out;
  if (!map_read(file, m)) return out;
  const auto* h = static_cast<const Header*>(m.base);
  for (const auto& s : h->slots) {
    const int64_t step = s.step.load(std::memory_order_acquire);
    if (step >= 0) out.push_back({s.generation, s.rank, step});
  }
  return out;
}

std::optional<PieceSet> read_snapshot(const std::filesystem::path& file, int64_t step) {
  Mapped m;
  if (!map_read(file, m)) return std::nullopt;
  const auto* h = static_cast<const Header*>(m.base);
  for (int64_t slot = 0; slot < 2; ++slot) {
    const SlotHeader& s = h->slots[slot];
    if (s.step.load(std::memory_order_acquire) != step) continue;
    const char* at = static_cast<const char*>(m.base) + kHeaderBytes + slot * h->slot_bytes;
    PieceSet set;
    set.generation = s.generation;
    set.rank = s.rank;
    set.step = step;
    set.meta = nlohmann::json::parse(std::string(at, static_cast<size_t>(s.meta_bytes)));
    const auto json = nlohmann::json::parse(std::string(at + h->meta_capacity, static_cast<size_t>(s.json_bytes)));
    set.json = json.at("json");
    set.rank_json = json.at("rank_json");
    set.bytes = torch::empty({s.data_bytes}, torch::kUInt8);
    std::memcpy(set.bytes.data_ptr(), at + h->meta_capacity + kJsonCapacity, static_cast<size_t>(s.data_bytes));
    return set;
  }
  return std::nullopt;
}

}  // namespace loom::elastic
