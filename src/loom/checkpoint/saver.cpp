#include "loom/checkpoint/saver.h"
#include "loom/core/strings.h"

#include <ATen/record_function.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "loom/checkpoint/crc32c.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/distributed/comm.h"
#include "loom/core/logging.h"
#include "loom/core/timer.h"

namespace loom::checkpoint {
namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

// Non-CPU or dtype-converted chunks of a synchronous save go through host memory in pieces of
// this size, so converting a large tensor never doubles its footprint.
constexpr int64_t kConvertPieceBytes = int64_t{64} << 20;
constexpr auto kFinalizePollInterval = std::chrono::milliseconds(20);
constexpr const char* kFailedSuffix = ".failed";
// O_DIRECT needs buffer addresses, file offsets and lengths aligned to the device's logical block
// size; 4096 covers every common device and filesystem.
constexpr int64_t kDirectIoAlignment = 4096;

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// The checkpoint's background threads take idle CPU rather than competing with training's
// intra-op threads (on Linux the nice value is per thread). A 2-thread parallel region stalls
// on whichever of its threads is preempted, so even a little stolen time costs a lot.
void lower_this_thread_priority() {
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  LOOM_REQUIRE(fd >= 0, "cannot open directory '", dir.string(), "' to flush it: ", errno_text());
  const int rc = ::fsync(fd);
  const std::string why = errno_text();
  ::close(fd);
  LOOM_REQUIRE(rc == 0, "cannot flush directory '", dir.string(), "': ", why);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

fs::path tmp_dir_of(const fs::path& folder, int64_t step) {
  return folder / (step_dir_name(step) + ".tmp");
}

std::string failed_marker_name(int rank) { return c10::str("rank-", rank, kFailedSuffix); }

// Writes one rank file with pwrite(2); finish() sets its final size and fsyncs it. With `direct`
// the file is opened with O_DIRECT when the filesystem allows it: aligned writes then go from our
// buffers to the device without a page-cache copy, and without the kernel's writeback work and
// dirty-page throttling, which on this class of machine made buffered saves several times slower
// and took CPU from training. An unaligned write falls back to buffered I/O for the rest.
class RankFileWriter {
 public:
  RankFileWriter(fs::path path, bool direct) : path_(std::move(path)) {
    const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
    if (direct) fd_ = ::open(path_.c_str(), flags | O_DIRECT, 0644);
    direct_ = fd_ >= 0;
    if (fd_ < 0) fd_ = ::open(path_.c_str(), flags, 0644);
    LOOM_REQUIRE(fd_ >= 0, "cannot create checkpoint file '", path_.string(), "': ", errno_text(),
                 "; check that the checkpoint folder is writable");
  }
  ~RankFileWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  RankFileWriter(const RankFileWriter&) = delete;
  RankFileWriter& operator=(const RankFileWriter&) = delete;

  bool direct() const { return direct_; }

  void write_at(int64_t offset, const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (size > 0) {
      const ssize_t n = ::pwrite(fd_, p, size, static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EINVAL && direct_) {  // not aligned for O_DIRECT: go buffered
        LOOM_REQUIRE(::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_DIRECT) == 0,
                     "cannot switch checkpoint file '", path_.string(), "' to buffered I/O: ",
                     errno_text());
        direct_ = false;
        continue;
      }
      LOOM_REQUIRE(n > 0, "cannot write checkpoint file '", path_.string(), "': ", errno_text());
      p += n;
      offset += n;
      size -= static_cast<size_t>(n);
    }
  }
  void append(const void* data, size_t size) {
    write_at(end_, data, size);
    end_ += static_cast<int64_t>(size);
  }

  // Cuts the zero padding of the last direct write; flushes data and size to the device.
  void finish(int64_t file_bytes) {
    LOOM_REQUIRE(::ftruncate(fd_, static_cast<off_t>(file_bytes)) == 0,
                 "cannot set the size of checkpoint file '", path_.string(), "': ", errno_text());
    LOOM_REQUIRE(::fsync(fd_) == 0, "cannot flush checkpoint file '", path_.string(), "': ",
                 errno_text());
    const int rc = ::close(fd_);
    fd_ = -1;
    LOOM_REQUIRE(rc == 0, "cannot close checkpoint file '", path_.string(), "': ", errno_text());
  }

 private:
  fs::path path_;
  int fd_ = -1;
  bool direct_ = false;
  int64_t end_ = 0;
};

struct GlobalTensor {
  std::string component;
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::kFloat;  // as stored
  friend bool operator==(const GlobalTensor&, const GlobalTensor&) = default;
};

struct WriteEntry {
  std::string tensor;
  std::string key;
  int64_t begin = 0;
  int64_t end = 0;
  std::vector<int64_t> box_offsets, box_sizes;  // empty: a range of the whole tensor
  torch::Tensor source;  // the live chunk; released once staged
  c10::ScalarType dtype = c10::kFloat;  // as stored
  int64_t byte_begin = 0;               // absolute offset in the rank file
  uint32_t crc = 0;                     // computed while staging (async) or writing (sync)
  int64_t nbytes() const { return (end - begin) * static_cast<int64_t>(c10::elementSize(dtype)); }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// One save in progress

struct ShardedSaver::Job {
  int rank = 0;
  int world = 1;
  int64_t step = 0;
  fs::path folder, tmp_dir, final_dir;
  SaveOptions options;
  SaverOptions saver;
  std::map<std::string, GlobalTensor> global;  // every rank's tensors
  std::vector<WriteEntry> entries;             // this rank's, in file order
  std::string header;                          // length prefix + JSON
  int64_t file_bytes = 0;
  Json global_json, rank_json;
  // One per device whose chunks were copied into pinned host memory at planning time (async saves
  // of CUDA tensors), recorded after the last copy; the staging thread waits on them.
  std::vector<c10::Event> device_copies;
  std::exception_ptr stage_error;  // set by the staging thread
  std::exception_ptr error;        // set by the writer thread
  double write_seconds = 0;
};

// ---------------------------------------------------------------------------------------------
// Staging: fixed host buffers ("slots") that together hold at most staging_max_bytes, filled in
// file order (header first) by the staging thread and drained by the writer. Each slot is one
// contiguous run of the rank file, so the writer issues one write per slot, and starts as soon as
// the first slot is full rather than after everything is staged. Slots are page-aligned (for
// O_DIRECT), allocated on first use and kept for later saves (the first save pays the page faults).

class ShardedSaver::Staging {
 public:
  // Small enough that writing overlaps staging, large enough that a write call is efficient; at
  // least 4 slots so the two threads never wait on a single buffer.
  static constexpr int64_t kMaxSlotBytes = int64_t{64} << 20;
  static constexpr int64_t kMinSlots = 4;
  struct Slot {
    std::unique_ptr<uint8_t, decltype(&std::free)> buffer{nullptr, &std::free};
    uint8_t* data = nullptr;
    int64_t offset = 0;  // in the rank file
    int64_t used = 0;
  };

  explicit Staging(int64_t max_bytes)
      : slot_bytes_(slot_size(max_bytes)), max_slots_(std::max<int64_t>(1, max_bytes / slot_bytes_)) {}
  int64_t slot_bytes() const { return slot_bytes_; }
  // Whether every slot is a whole number of O_DIRECT blocks (not with tiny staging budgets).
  bool direct_io() const { return slot_bytes_ % kDirectIoAlignment == 0; }

  void begin() {
    std::lock_guard lock(mutex_);
    closed_ = aborted_ = false;
    filled_.clear();
    free_.clear();
    for (auto& s : slots_) free_.push_back(s.get());
  }

  // A free slot; nullptr once the writer aborted.
  Slot* acquire() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] {
      return aborted_ || !free_.empty() || static_cast<int64_t>(slots_.size()) < max_slots_;
    });
    if (aborted_) return nullptr;
    Slot* slot = nullptr;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      slots_.push_back(std::make_unique<Slot>());
      slot = slots_.back().get();
      void* p = nullptr;
      LOOM_REQUIRE(::posix_memalign(&p, kDirectIoAlignment, static_cast<size_t>(slot_bytes_)) == 0,
                   "cannot allocate ", slot_bytes_, " bytes of checkpoint staging memory");
      slot->buffer.reset(static_cast<uint8_t*>(p));
      slot->data = slot->buffer.get();
    }
    slot->used = 0;
    return slot;
  }
  void push(Slot* slot) {
    std::lock_guard lock(mutex_);
    filled_.push_back(slot);
    cv_.notify_all();
  }
  void close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
    cv_.notify_all();
  }
  // The next filled slot; nullptr when closed and drained, or aborted.
  Slot* pop() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return aborted_ || closed_ || !filled_.empty(); });
    if (aborted_ || filled_.empty()) return nullptr;
    Slot* slot = filled_.front();
    filled_.pop_front();
    return slot;
  }
  void release(Slot* slot) {
    std::lock_guard lock(mutex_);
    free_.push_back(slot);
    cv_.notify_all();
  }
  void abort() {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    cv_.notify_all();
  }
  bool aborted() const {
    std::lock_guard lock(mutex_);
    return aborted_;
  }

 private:
  static int64_t slot_size(int64_t max_bytes) {
    const int64_t want = std::min(kMaxSlotBytes, max_bytes / kMinSlots);
    if (want >= kDirectIoAlignment) return want / kDirectIoAlignment * kDirectIoAlignment;
    return std::max<int64_t>(8, want / 8 * 8);
  }

  int64_t slot_bytes_;
  int64_t max_slots_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<Slot*> free_;
  std::deque<Slot*> filled_;
  bool closed_ = false;
  bool aborted_ = false;
};

namespace {

using Job = ShardedSaver::Job;
using Staging = ShardedSaver::Staging;

// ---------------------------------------------------------------------------------------------
// Writing and publishing

void write_direct(Job& job) {
  RankFileWriter out(job.tmp_dir / rank_file_name(job.rank), /*direct=*/false);
  out.append(job.header.data(), job.header.size());
  for (WriteEntry& e : job.entries) {
    const torch::Tensor flat = e.source.reshape(-1);
    auto append = [&](const torch::Tensor& piece) {
      e.crc = crc32c_extend(e.crc, piece.data_ptr(), piece.nbytes());
      out.append(piece.data_ptr(), piece.nbytes());
    };
    if (flat.device().is_cpu() && flat.is_contiguous() && flat.scalar_type() == e.dtype) {
      append(flat);  // straight from live memory: the training thread is blocked
    } else {
      const int64_t elem = std::max<int64_t>(flat.element_size(), c10::elementSize(e.dtype));
      const int64_t piece = std::max<int64_t>(1, kConvertPieceBytes / elem);
      for (int64_t done = 0; done < flat.numel(); done += piece) {
        const int64_t n = std::min(piece, flat.numel() - done);
        append(flat.narrow(0, done, n).to(torch::kCPU, e.dtype).contiguous());
      }
    }
    e.source = torch::Tensor();
  }
  out.finish(job.file_bytes);
}

// Async saves of CUDA tensors (training thread, at planning): each chunk is copied into a pinned
// host buffer at once, with non_blocking copies on the current stream — DMA transfers that overlap
// the kernels of the next step, where the staging thread's pageable copies would each block on a
// synchronous transfer. An event recorded after the last copy is the only synchronisation: the
// staging thread waits on it before it reads the host copies (stage()). Later kernels on the same
// stream (the optimizer step) are ordered after the copies. `pool` keeps the pinned buffers for
// the next save, since pinning memory is slow; a chunk of another size or dtype replaces its
// buffer. Pinned memory needs CUDA, hence only CUDA chunks; others stay with the staging thread.
void copy_device_chunks_to_pinned(Job& job, std::vector<torch::Tensor>& pool) {
  size_t used = 0;
  std::vector<c10::Device> devices;
  for (WriteEntry& e : job.entries) {
    if (!e.source.is_cuda()) continue;
    const torch::Tensor flat = e.source.reshape(-1);
    if (used == pool.size()) pool.emplace_back();
    torch::Tensor& host = pool[used++];
    if (!host.defined() || host.numel() != flat.numel() || host.scalar_type() != flat.scalar_type()) {
      host = torch::empty({flat.numel()},
                          torch::TensorOptions().dtype(flat.scalar_type()).pinned_memory(true));
    }
    host.copy_(flat, /*non_blocking=*/true);
    e.source = host;
    if (std::find(devices.begin(), devices.end(), flat.device()) == devices.end()) {
      devices.push_back(flat.device());
    }
  }
  pool.resize(used);  // buffers of chunks this state no longer has
  for (const c10::Device& device : devices) {
    job.device_copies.emplace_back(device.type());
    job.device_copies.back().record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
}

// Staging thread: copies (and converts) the header and every entry into slots, in file order,
// computing each entry's CRC-32C in the same pass.
void stage(Job& job, Staging& staging) {
  // CUDA chunks were copied into pinned host memory at planning: wait for those copies once.
  for (const c10::Event& copies : job.device_copies) copies.synchronize();
  Staging::Slot* slot = staging.acquire();
  if (slot == nullptr) return;
  slot->offset = 0;
  // Appends n items of `elem` bytes through fill(dst, first, count); false once aborted.
  auto append = [&](int64_t n, int64_t elem, const auto& fill) {
    int64_t done = 0;
    while (done < n) {
      // Entries are ordered by descending element size after the 8-byte aligned header, so
      // `used` stays a multiple of `elem` and a slot is only ever pushed completely full (or at
      // the end): every write but the last is a whole number of O_DIRECT blocks.
      const int64_t room = (staging.slot_bytes() - slot->used) / elem;
      if (room == 0) {
        const int64_t next = slot->offset + slot->used;
        staging.push(slot);
        slot = staging.acquire();
        if (slot == nullptr) return false;
        slot->offset = next;
        continue;
      }
      const int64_t k = std::min(room, n - done);
      fill(slot->data + slot->used, done, k);
      slot->used += k * elem;
      done += k;
    }
    return true;
  };
  const bool header_staged = append(static_cast<int64_t>(job.header.size()), 1,
                                    [&](uint8_t* dst, int64_t first, int64_t k) {
                                      std::memcpy(dst, job.header.data() + first, static_cast<size_t>(k));
                                    });
  if (!header_staged) return;
  for (WriteEntry& e : job.entries) {
    const torch::Tensor flat = e.source.reshape(-1);
    const auto elem = static_cast<int64_t>(c10::elementSize(e.dtype));
    const bool raw = flat.device().is_cpu() && flat.is_contiguous() && flat.scalar_type() == e.dtype;
    const auto* src = raw ? static_cast<const uint8_t*>(flat.data_ptr()) : nullptr;
    const bool staged = append(e.end - e.begin, elem, [&](uint8_t* dst, int64_t first, int64_t k) {
      const auto bytes = static_cast<size_t>(k * elem);
      if (raw) {
        e.crc = crc32c_copy(e.crc, dst, src + first * elem, bytes);
      } else {  // another device or an export dtype: convert, then checksum what is stored
        torch::from_blob(dst, {k}, torch::TensorOptions().dtype(e.dtype)).copy_(flat.narrow(0, first, k));
        e.crc = crc32c_extend(e.crc, dst, bytes);
      }
    });
    e.source = torch::Tensor();
    if (!staged) return;
  }
  if (slot->used > 0) {
    staging.push(slot);
  } else {
    staging.release(slot);
  }
}

// Writer thread: drains the slots into the rank file.
void write_staged(Job& job, Staging& staging) {
  RankFileWriter out(job.tmp_dir / rank_file_name(job.rank), staging.direct_io());
  while (Staging::Slot* slot = staging.pop()) {
    auto bytes = slot->used;
    if (out.direct() && bytes % kDirectIoAlignment != 0) {
      // The file's last piece: pad it to a whole block with zeros that finish() cuts off again.
      const int64_t padded = round_up(bytes, kDirectIoAlignment);
      std::memset(slot->data + bytes, 0, static_cast<size_t>(padded - bytes));
      bytes = padded;
    }
    out.write_at(slot->offset, slot->data, static_cast<size_t>(bytes));
    staging.release(slot);
  }
  LOOM_REQUIRE(!staging.aborted(), "checkpoint step ", job.step,
               ": staging was interrupted before this rank's chunks were complete");
  out.finish(job.file_bytes);
}

// Rank R's report, written after its data file is durable: its presence means "R is done".
void write_rank_meta(const Job& job) {
  Json chunks = Json::array();
  for (const WriteEntry& e : job.entries) {
    Json c = {{"tensor", e.tensor},
              {"begin", e.begin},
              {"end", e.end},
              {"key", e.key},
              {"bytes", {e.byte_begin, e.byte_begin + e.nbytes()}},
              {"crc32c", e.crc}};
    if (!e.box_offsets.empty()) c["box"] = {{"offsets", e.box_offsets}, {"sizes", e.box_sizes}};
    chunks.push_back(std::move(c));
  }
  const Json meta = {{"rank", job.rank},
                     {"file", rank_file_name(job.rank)},
                     {"file_bytes", job.file_bytes},
                     {"chunks", std::move(chunks)},
                     {"rank_json", job.rank_json}};
  write_text_file_atomically(job.tmp_dir / rank_meta_name(job.rank), meta.dump());
  fsync_dir(job.tmp_dir);
}

void write_failed_marker(const Job& job, const std::string& message) {
  try {
    fs::create_directories(job.tmp_dir);
    write_text_file_atomically(job.tmp_dir / failed_marker_name(job.rank), message + "\n");
  } catch (const std::exception& e) {
    log::error("checkpoint step ", job.step, ": cannot record this rank's failure in '",
               job.tmp_dir.string(), "': ", e.what());
  }
}

void wait_for_ranks(const Job& job) {
  const auto deadline = std::chrono::steady_clock::now() + job.saver.finalize_timeout;
  for (;;) {
    std::vector<int> missing;
    for (int r = 0; r < job.world; ++r) {
      const fs::path failed = job.tmp_dir / failed_marker_name(r);
      if (fs::exists(failed)) {
        std::string why = read_text(failed);
        while (!why.empty() && why.back() == '\n') why.pop_back();
        fail("checkpoint step ", job.step, ": rank ", r, " could not write its part (", why,
             "); '", job.tmp_dir.string(), "' is left incomplete");
      }
      if (!fs::exists(job.tmp_dir / rank_meta_name(r))) missing.push_back(r);
    }
    if (missing.empty()) return;
    // Elastic training re-forms without the ranks that are gone: their parts never come.
    if (distributed::collectives_interrupted()) {
      fail("checkpoint step ", job.step, ": abandoned with its membership (a rank is gone); '",
           job.tmp_dir.string(), "' is left incomplete");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::string ranks;
      for (const int r : missing) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
      fail("checkpoint step ", job.step, ": rank(s) ", ranks, " did not finish writing '",
           job.tmp_dir.string(), "' within ",
           std::chrono::duration_cast<std::chrono::seconds>(job.saver.finalize_timeout).count(),
           " s; the checkpoint is left incomplete (raise the checkpoint finalize timeout if saves "
           "are this slow)");
    }
    std::this_thread::sleep_for(kFinalizePollInterval);
  }
}

CheckpointMetadata merge_metadata(const Job& job) {
  CheckpointMetadata m;
  m.step = job.step;
  m.world_size = job.world;
  m.model_only = job.options.model_only;
  m.export_dtype = job.options.export_dtype;
  m.json = job.global_json;
  m.rank_json.resize(static_cast<size_t>(job.world), Json::object());
  for (const auto& [name, g] : job.global) {
    SavedTensor t;
    t.component = g.component;
    t.shape = g.shape;
    t.dtype = g.dtype;
    m.tensors.emplace(name, std::move(t));
  }
  for (int r = 0; r < job.world; ++r) {
    const fs::path path = job.tmp_dir / rank_meta_name(r);
    try {
      const Json meta = Json::parse(read_text(path));
      const auto file = meta.at("file").get<std::string>();
      m.file_bytes[file] = meta.at("file_bytes").get<int64_t>();
      m.rank_json[static_cast<size_t>(r)] = meta.at("rank_json");
      for (const auto& c : meta.at("chunks")) {
        SavedChunk sc;
        sc.begin = c.at("begin").get<int64_t>();
        sc.end = c.at("end").get<int64_t>();
        if (c.contains("box")) {
          sc.box_offsets = c.at("box").at("offsets").get<std::vector<int64_t>>();
          sc.box_sizes = c.at("box").at("sizes").get<std::vector<int64_t>>();
        }
        sc.file = file;
        sc.key = c.at("key").get<std::string>();
        const auto bytes = c.at("bytes").get<std::vector<int64_t>>();
        sc.byte_begin = bytes.at(0);
        sc.byte_end = bytes.at(1);
        sc.crc32c = c.at("crc32c").get<uint32_t>();
        m.tensors.at(c.at("tensor").get<std::string>()).chunks.push_back(std::move(sc));
      }
    } catch (const std::exception& e) {
      fail("checkpoint step ", job.step, ": cannot read rank ", r, "'s report '", path.string(),
           "': ", e.what());
    }
  }
  for (auto& [name, t] : m.tensors) {
    std::sort(t.chunks.begin(), t.chunks.end(),
              [](const SavedChunk& a, const SavedChunk& b) { return a.region() < b.region(); });
  }
  return m;
}

void prune(const Job& job) {
  std::error_code ec;
  auto remove = [&](const fs::path& dir, const char* why) {
    fs::remove_all(dir, ec);
    if (ec) {
      log::warn("cannot remove ", why, " checkpoint '", dir.string(), "': ", ec.message());
    } else {
      log::debug("removed ", why, " checkpoint '", dir.string(), "'");
    }
  };
  if (job.saver.keep_latest_k > 0) {
    int kept = 1;  // the checkpoint just written, which is never removed
    for (const CheckpointInfo& info : list_complete_checkpoints(job.folder)) {
      if (info.step == job.step) continue;
      if (kept < job.saver.keep_latest_k) {
        ++kept;
      } else {
        remove(info.path, "old");
      }
    }
  }
  // Leftovers of crashed runs: unfinished saves of earlier steps (saves are sequential, so none of
  // them is still being written).
  for (const auto& entry : fs::directory_iterator(job.folder, ec)) {
    std::string name = entry.path().filename().string();
    const bool tmp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;
    if (tmp) name.resize(name.size() - 4);
    const auto step = parse_step_dir_name(name);
    if (!step || *step >= job.step || !entry.is_directory(ec)) continue;
    if (tmp || !fs::exists(entry.path() / kCompleteMarker, ec)) remove(entry.path(), "incomplete");
  }
}

// Rank 0, once every rank has reported: metadata, rename, marker, pruning.
void publish(const Job& job) {
  wait_for_ranks(job);
  const CheckpointMetadata metadata = merge_metadata(job);
  const std::string text = metadata.to_json().dump(1);
  // Re-parse what we are about to publish: the loader will run the same checks.
  CheckpointMetadata::from_json(Json::parse(text), (job.tmp_dir / kMetadataFile).string());
  write_text_file_atomically(job.tmp_dir / kMetadataFile, text);
  // The ranks' reports are merged into metadata.json now; the published checkpoint holds only the
  // rank files, metadata.json and the marker.
  for (int r = 0; r < job.world; ++r) fs::remove(job.tmp_dir / rank_meta_name(r));
  fsync_dir(job.tmp_dir);

  std::error_code ec;
  fs::path replaced;
  if (fs::exists(job.final_dir, ec)) {  // an earlier run saved this step: replace it
    replaced = job.folder / c10::str(step_dir_name(job.step), ".replaced-", ::getpid());
    fs::rename(job.final_dir, replaced, ec);
    LOOM_REQUIRE(!ec, "cannot move the existing checkpoint '", job.final_dir.string(),
                 "' aside: ", ec.message());
  }
  fs::rename(job.tmp_dir, job.final_dir, ec);
  LOOM_REQUIRE(!ec, "cannot rename '", job.tmp_dir.string(), "' to '", job.final_dir.string(),
               "': ", ec.message());
  fsync_dir(job.folder);
  const Json marker = {{"step", job.step},
                       {"world_size", job.world},
                       {"metadata_crc32c", crc32c(text.data(), text.size())}};
  write_text_file_atomically(job.final_dir / kCompleteMarker, marker.dump() + "\n");
  fsync_dir(job.final_dir);
  if (!replaced.empty()) fs::remove_all(replaced, ec);
  prune(job);
}

void finish_rank(Job& job) {
  write_rank_meta(job);
  if (job.rank == 0) publish(job);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ShardedSaver

ShardedSaver::ShardedSaver(std::shared_ptr<CheckpointGroup> group, SaverOptions options)
    : group_(std::move(group)), options_(options) {
  LOOM_REQUIRE(group_ != nullptr, "ShardedSaver needs a CheckpointGroup (single_process_group() "
               "for one process)");
  LOOM_REQUIRE_USAGE(options_.keep_latest_k >= 0, "checkpoint keep_latest_k must be >= 0 (0 keeps "
                     "every checkpoint), got ", options_.keep_latest_k);
  LOOM_REQUIRE_USAGE(options_.staging_max_bytes >= 4096, "checkpoint staging memory must be at "
                     "least 4096 bytes, got ", options_.staging_max_bytes);
  LOOM_REQUIRE_USAGE(options_.finalize_timeout.count() > 0,
                     "checkpoint finalize timeout must be positive");
  staging_ = std::make_unique<Staging>(options_.staging_max_bytes);
}

ShardedSaver::~ShardedSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    log::error("checkpoint save failed: ", e.what());
  }
}

std::shared_ptr<ShardedSaver::Job> ShardedSaver::plan(const ShardedStateDict& state,
                                                      const fs::path& folder, int64_t step,
                                                      const SaveOptions& options) {
  LOOM_REQUIRE_USAGE(!folder.empty(), "checkpoint folder is empty; set the checkpoint folder");
  LOOM_REQUIRE_USAGE(step >= 0, "checkpoint step must be >= 0, got ", step);
  auto job = std::make_shared<Job>();
  job->rank = group_->rank();
  job->world = group_->size();
  job->step = step;
  job->folder = folder;
  job->tmp_dir = tmp_dir_of(folder, step);
  job->final_dir = folder / step_dir_name(step);
  job->options = options;
  job->saver = options_;
  job->global_json = state.json();
  job->rank_json = state.rank_json();

  // This rank's description, or the error that makes every rank fail together (a rank throwing
  // alone would leave the others waiting in the gather).
  Json local = Json::object();
  try {
    if (options.export_dtype) {
      LOOM_REQUIRE_USAGE(c10::isFloatingType(*options.export_dtype), "checkpoint export dtype ",
                         c10::toString(*options.export_dtype),
                         " is not floating point; use float32, bfloat16 or float16");
    }
    Json tensors = Json::object();
    for (const auto& [name, t] : state.tensors()) {
      if (options.model_only && t.component != kModelComponent) continue;
      const c10::ScalarType stored =
          options.export_dtype && c10::isFloatingType(t.dtype) ? *options.export_dtype : t.dtype;
      Json ranges = Json::array();
      for (const LocalChunk& c : t.chunks) {
        Json range = {c.begin, c.end()};
        if (!c.box_offsets.empty()) range.push_back({c.box_offsets, c.box_sizes});
        ranges.push_back(std::move(range));
      }
      tensors[name] = {{"component", t.component},
                       {"shape", t.shape},
                       {"dtype", safetensors_dtype_name(stored)},
                       {"ranges", std::move(ranges)}};
    }
    local["tensors"] = std::move(tensors);
    if (job->rank == 0) {
      std::error_code ec;
      fs::create_directories(folder, ec);
      LOOM_REQUIRE(!ec, "cannot create checkpoint folder '", folder.string(), "': ", ec.message());
      fs::remove_all(job->tmp_dir, ec);  // a crashed run's unfinished save of this step
      LOOM_REQUIRE(!ec, "cannot remove the stale '", job->tmp_dir.string(), "': ", ec.message());
    }
  } catch (const UsageError& e) {
    local = {{"error", e.what()}, {"usage", true}};
  } catch (const std::exception& e) {
    local = {{"error", e.what()}, {"usage", false}};
  }
  const std::vector<std::string> gathered = group_->all_gather(local.dump());
  std::vector<Json> plans;
  for (const std::string& bytes : gathered) plans.push_back(Json::parse(bytes));
  for (int r = 0; r < job->world; ++r) {
    if (plans[r].contains("error")) {
      const auto why = plans[r]["error"].get<std::string>();
      if (r == job->rank && plans[r]["usage"].get<bool>()) fail_usage(why);
      if (r == job->rank) fail(why);
      fail("checkpoint step ", step, ": rank ", r, " cannot save (", why, ")");
    }
  }

  // The global plan, computed identically on every rank.
  std::map<std::string, std::map<Region, std::vector<int>>> holders;
  std::map<std::string, int> first_rank;
  for (int r = 0; r < job->world; ++r) {
    for (const auto& [name, tj] : plans[r]["tensors"].items()) {
      GlobalTensor g{tj["component"].get<std::string>(), tj["shape"].get<std::vector<int64_t>>(),
                     safetensors_dtype(tj["dtype"].get<std::string>())};
      const auto [it, inserted] = job->global.emplace(name, g);
      if (inserted) {
        first_rank[name] = r;
      } else if (!(it->second == g)) {
        fail("checkpoint step ", step, ": tensor '", name, "' is ", c10::toString(g.dtype), " ",
             shape_text(g.shape), " (", g.component, ") on rank ", r, " but ",
             c10::toString(it->second.dtype), " ", shape_text(it->second.shape), " (",
             it->second.component, ") on rank ", first_rank[name],
             "; every rank must describe a tensor the same way");
      }
      auto& ranges = holders[name];
      for (const auto& range : tj["ranges"]) {
        Region region{{}, {}, range[0].get<int64_t>(), range[1].get<int64_t>()};
        if (range.size() > 2) {
          region.box_offsets = range[2][0].get<std::vector<int64_t>>();
          region.box_sizes = range[2][1].get<std::vector<int64_t>>();
        }
        ranges[region].push_back(r);
      }
    }
  }
  // Identical regions on several ranks are replicas (written once); the distinct regions must hold
  // every element exactly once.
  for (const auto& [name, g] : job->global) {
    std::vector<Region> regions;
    for (const auto& [region, ranks] : holders[name]) regions.push_back(region);
    const std::string error = tiling_error(g.shape, regions);
    if (!error.empty()) {
      std::string who;
      for (const auto& [region, ranks] : holders[name]) {
        who += c10::str(who.empty() ? "" : ", ", describe(region), " on rank ", ranks[0]);
      }
      fail("checkpoint step ", step, ": tensor '", name, "' ", shape_text(g.shape), ": ", error,
           " (ranks hold ", who, "; replicas must hold identical chunks)");
    }
  }

  // Writers: a range held by one rank is written by it; a replicated range by its least-loaded
  // holder (largest ranges first), so replicas share the writing instead of rank 0 doing it all.
  std::vector<int64_t> load(static_cast<size_t>(job->world), 0);
  struct Shared {
    int64_t bytes;
    std::string name;
    Region region;
    std::vector<int> ranks;
  };
  std::vector<Shared> shared;
  std::set<std::pair<std::string, Region>> mine;
  for (const auto& [name, ranges] : holders) {
    const auto elem = static_cast<int64_t>(c10::elementSize(job->global.at(name).dtype));
    for (const auto& [region, ranks] : ranges) {
      const int64_t bytes = region.numel() * elem;
      if (ranks.size() == 1) {
        load[static_cast<size_t>(ranks[0])] += bytes;
        if (ranks[0] == job->rank) mine.emplace(name, region);
      } else {
        shared.push_back({bytes, name, region, ranks});
      }
    }
  }
  std::stable_sort(shared.begin(), shared.end(),
                   [](const Shared& a, const Shared& b) { return a.bytes > b.bytes; });
  for (const Shared& s : shared) {
    int best = s.ranks[0];
    for (const int r : s.ranks) {
      if (load[static_cast<size_t>(r)] < load[static_cast<size_t>(best)]) best = r;
    }
    load[static_cast<size_t>(best)] += s.bytes;
    if (best == job->rank) mine.emplace(s.name, s.region);
  }

  // This rank's file: its chunks by descending element size (so every chunk is aligned for its
  // dtype, and the file can be read zero-copy), then by name and offset.
  for (const auto& [name, t] : state.tensors()) {
    if (!job->global.count(name)) continue;  // model_only filtered it out
    for (const LocalChunk& c : t.chunks) {
      if (!mine.count({name, c.region()})) continue;
      WriteEntry e;
      e.tensor = name;
      e.key = chunk_key(name, c.region());
      e.begin = c.begin;
      e.end = c.end();
      e.box_offsets = c.box_offsets;
      e.box_sizes = c.box_sizes;
      e.source = c.data;
      e.dtype = job->global.at(name).dtype;
      job->entries.push_back(std::move(e));
    }
  }
  std::stable_sort(job->entries.begin(), job->entries.end(),
                   [](const WriteEntry& a, const WriteEntry& b) {
                     return c10::elementSize(a.dtype) > c10::elementSize(b.dtype);
                   });
  Json header = Json::object();
  header["__metadata__"] = {{"format", kMetadataFormat},
                            {"step", std::to_string(step)},
                            {"rank", std::to_string(job->rank)}};
  int64_t offset = 0;
  for (WriteEntry& e : job->entries) {
    header[e.key] = {{"dtype", safetensors_dtype_name(e.dtype)},
                     {"shape", {e.end - e.begin}},
                     {"data_offsets", {offset, offset + e.nbytes()}}};
    e.byte_begin = offset;
    offset += e.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data section 8-byte aligned
  const uint64_t header_len = text.size();
  job->header.assign(reinterpret_cast<const char*>(&header_len), 8);
  job->header += text;
  const auto data_start = static_cast<int64_t>(job->header.size());
  for (WriteEntry& e : job->entries) e.byte_begin += data_start;
  job->file_bytes = data_start + offset;
  return job;
}

fs::path ShardedSaver::save(const ShardedStateDict& state, const fs::path& folder, int64_t step,
                            const SaveOptions& options) {
  wait();
  // Profiler range (profiling/profiler.h): the whole synchronous save, as training waits for it.
  RECORD_USER_SCOPE("loom::checkpoint::save");
  Timer timer;
  const std::shared_ptr<Job> job = plan(state, folder, step, options);
  // Two agreements: every rank wrote its file (else nobody publishes), then rank 0 published.
  std::exception_ptr error;
  try {
    fs::create_directories(job->tmp_dir);
    write_direct(*job);
    write_rank_meta(*job);
  } catch (const std::exception& e) {
    error = std::current_exception();
    write_failed_marker(*job, e.what());
  }
  if (group_->all_reduce_max(error ? 1 : 0) != 0) {
    if (error) std::rethrow_exception(error);
    fail("checkpoint step ", step, " failed on another rank (see its log); '",
         job->tmp_dir.string(), "' is left incomplete");
  }
  if (job->rank == 0) {
    try {
      publish(*job);
    } catch (const std::exception&) {
      error = std::current_exception();
    }
  }
  if (group_->all_reduce_max(error ? 1 : 0) != 0) {
    if (error) std::rethrow_exception(error);
    fail("checkpoint step ", step, " could not be published by rank 0 (see its log)");
  }
  stats_ = {step, job->file_bytes, timer.seconds(), timer.seconds()};
  if (job->rank == 0) {
    log::info("saved checkpoint '", job->final_dir.string(), "' (", job->file_bytes >> 20,
              " MiB on rank 0, ", timer.seconds(), " s)");
  }
  return job->final_dir;
}

void ShardedSaver::begin_async_save(const ShardedStateDict& state, const fs::path& folder,
                                    int64_t step, const SaveOptions& options) {
  wait();
  // Profiler range: the training thread's share of an async save (planning, device chunks into
  // pinned memory, starting the threads). The stager and writer threads are not in the trace; what
  // they cost the training thread shows as loom::checkpoint::wait_staged.
  RECORD_USER_SCOPE("loom::checkpoint::stage");
  Timer timer;
  std::shared_ptr<Job> job = plan(state, folder, step, options);
  std::error_code ec;
  fs::create_directories(job->tmp_dir, ec);
  if (ec) {
    const std::string why = c10::str("cannot create '", job->tmp_dir.string(), "': ", ec.message());
    write_failed_marker(*job, why);  // so rank 0 stops waiting for this rank
    fail(why);
  }
  try {
    copy_device_chunks_to_pinned(*job, pinned_);
  } catch (const std::exception& e) {
    write_failed_marker(*job, e.what());  // so rank 0 stops waiting for this rank
    throw;
  }
  staging_->begin();
  job_ = job;
  Staging* staging = staging_.get();
  writer_ = std::thread([job, staging] {
    lower_this_thread_priority();
    Timer write_timer;
    try {
      write_staged(*job, *staging);
      finish_rank(*job);
    } catch (const std::exception& e) {
      job->error = std::current_exception();
      staging->abort();  // unblock the staging thread if it is still copying
      write_failed_marker(*job, e.what());
    }
    job->write_seconds = write_timer.seconds();
  });
  stager_ = std::thread([job, staging] {
    lower_this_thread_priority();
    try {
      stage(*job, *staging);
      staging->close();
    } catch (...) {
      job->stage_error = std::current_exception();
      staging->abort();  // the writer then fails and marks this rank failed
    }
  });
  stats_ = {step, job->file_bytes, timer.seconds(), 0};
}

void ShardedSaver::wait_staged() {
  if (!stager_.joinable()) return;
  RECORD_USER_SCOPE("loom::checkpoint::wait_staged");
  Timer timer;
  stager_.join();
  stats_.blocked_seconds += timer.seconds();
  if (staging_->aborted()) wait();  // staging or writing failed: report it now
}

void ShardedSaver::save_async(const ShardedStateDict& state, const fs::path& folder, int64_t step,
                              const SaveOptions& options) {
  begin_async_save(state, folder, step, options);
  wait_staged();
}

void ShardedSaver::wait() {
  if (!stager_.joinable() && !writer_.joinable()) return;
  RECORD_USER_SCOPE("loom::checkpoint::wait");
  if (stager_.joinable()) stager_.join();
  if (!writer_.joinable()) return;
  writer_.join();
  const std::shared_ptr<Job> job = std::move(job_);
  stats_.write_seconds = job->write_seconds;
  if (job->stage_error) std::rethrow_exception(job->stage_error);
  if (job->error) std::rethrow_exception(job->error);
  if (job->rank == 0) {
    log::info("saved checkpoint '", job->final_dir.string(), "' asynchronously (",
              job->file_bytes >> 20, " MiB on rank 0, ", job->write_seconds,
              " s in background; training waited ", stats_.blocked_seconds, " s)");
  }
}

}  // namespace loom::checkpoint
