#include "loom/fsdp/distributed_buffer.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <malloc.h>
#include <sys/mman.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "loom/core/error.h"
#include "loom/core/memory.h"

namespace loom::fsdp {

// ---------------------------------------------------------------------------------------------
// BlockCache

namespace {

// glibc serves a large malloc with mmap, and when such a chunk is freed it raises its mmap
// threshold to the chunk's size (up to 32 MiB), so from then on chunks of that size come from the
// heap, where interleaving with activations fragments it and their pages stay resident. FSDP frees
// and re-allocates tens-of-MiB buffers (unsharded groups, Gloo's reduce-scatter scratch) every
// step, so on a small model this kept ~0.85 GiB per rank resident on the 124M benchmark
// (bench/fsdp_vs_fsdp2.py). A fixed threshold keeps such chunks mmapped: freed means returned.
// An explicit MALLOC_MMAP_THRESHOLD_ in the environment wins.
void pin_malloc_mmap_threshold() {
#ifdef __GLIBC__
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) mallopt(M_MMAP_THRESHOLD, 16 << 20);
  });
#endif
}

}  // namespace

// The memory of the released CPU buffers of one size, kept for the next buffer of that size to
// take: every transformer block's group has the same size, so the buffer a block releases after
// its forward is the one the next block gathers into, without a page fault or a zero-fill by the
// kernel. It holds at most as many blocks as were in use at once, and gives them back to the
// system when the last ReleasableBuffer of its size is destroyed.
class BlockCache {
 public:
  explicit BlockCache(size_t bytes) : bytes_(bytes) {}
  ~BlockCache() {
    for (void* p : free_) munmap(p, bytes_);
  }

  static std::shared_ptr<BlockCache> for_size(size_t bytes) {
    static std::mutex mutex;
    static std::map<size_t, std::weak_ptr<BlockCache>> caches;
    std::lock_guard<std::mutex> lock(mutex);
    std::shared_ptr<BlockCache> cache = caches[bytes].lock();
    if (!cache) {
      cache = std::make_shared<BlockCache>(bytes);
      caches[bytes] = cache;
    }
    return cache;
  }

  // Memory that returns to this cache when the DataPtr drops it.
  static at::DataPtr take(const std::shared_ptr<BlockCache>& cache) {
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(cache->mutex_);
      if (!cache->free_.empty()) {
        p = cache->free_.back();
        cache->free_.pop_back();
      }
    }
    if (p == nullptr) {
      p = mmap(nullptr, cache->bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      LOOM_REQUIRE(p != MAP_FAILED, "FSDP could not map ", cache->bytes_,
                   " bytes for an unsharded buffer (out of memory); fix: a smaller model or "
                   "batch per rank, or more ranks");
    }
    return at::DataPtr(p, new Ticket{cache, p}, &give_back, c10::Device(c10::kCPU));
  }

 private:
  struct Ticket {
    std::shared_ptr<BlockCache> cache;
    void* p;
  };
  static void give_back(void* ticket) {
    auto* t = static_cast<Ticket*>(ticket);
    {
      std::lock_guard<std::mutex> lock(t->cache->mutex_);
      t->cache->free_.push_back(t->p);
    }
    delete t;
  }

  size_t bytes_;
  std::mutex mutex_;
  std::vector<void*> free_;
};

// ---------------------------------------------------------------------------------------------
// ReleasableBuffer

ReleasableBuffer::ReleasableBuffer(int64_t numel, const torch::TensorOptions& options) {
  TORCH_CHECK(numel >= 0, "ReleasableBuffer needs numel >= 0, got ", numel);
  const auto opts = options.requires_grad(false);
  if (opts.device().is_cpu() && numel > 0) {
    pin_malloc_mmap_threshold();
    const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(
                                                           c10::typeMetaToScalarType(opts.dtype()));
    cache_ = BlockCache::for_size(bytes);
    torch::NoGradGuard no_grad;
    c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, BlockCache::take(cache_),
                         /*allocator=*/nullptr, /*resizable=*/false);
    flat_ = torch::empty({0}, opts).set_(storage, 0, {numel}, {1});
  } else {
    memory::UntrackedAllocationScope untracked;
    flat_ = torch::empty({numel}, opts);
  }
  capacity_bytes_ = static_cast<int64_t>(flat_.nbytes());
  if (capacity_bytes_ > 0) memory::note_comm_buffer_bytes(flat_.device(), capacity_bytes_);
}

ReleasableBuffer::ReleasableBuffer(ReleasableBuffer&& other) noexcept
    : flat_(std::move(other.flat_)), capacity_bytes_(other.capacity_bytes_), cache_(std::move(other.cache_)) {
  other.flat_ = torch::Tensor();
  other.capacity_bytes_ = 0;
}

ReleasableBuffer& ReleasableBuffer::operator=(ReleasableBuffer&& other) noexcept {
  if (this != &other) {
    if (allocated() && capacity_bytes_ > 0) memory::note_comm_buffer_bytes(flat_.device(), -capacity_bytes_);
    flat_ = std::move(other.flat_);
    capacity_bytes_ = other.capacity_bytes_;
    cache_ = std::move(other.cache_);
    other.flat_ = torch::Tensor();
    other.capacity_bytes_ = 0;
  }
  return *this;
}

ReleasableBuffer::~ReleasableBuffer() {
  // Views (autograd's saved tensors) may outlive the buffer and keep its memory: that memory is
  // no longer a buffer in flight, so only the account closes here.
  if (allocated() && capacity_bytes_ > 0) memory::note_comm_buffer_bytes(flat_.device(), -capacity_bytes_);
}

bool ReleasableBuffer::allocated() const {
  return flat_.defined() &&
         (capacity_bytes_ == 0 || flat_.storage().unsafeGetStorageImpl()->data() != nullptr);
}

void ReleasableBuffer::allocate() {
  if (!flat_.defined() || allocated()) return;
  c10::StorageImpl* storage = flat_.storage().unsafeGetStorageImpl();
  // The CUDA caching allocator serves the *current* device, which need not be the buffer's.
  const c10::OptionalDeviceGuard device_guard(
      storage->device().is_cpu() ? std::nullopt : std::make_optional(storage->device()));
  // Same StorageImpl, new memory: every tensor viewing this storage sees it.
  if (cache_) {
    storage->set_data_ptr_noswap(BlockCache::take(cache_));
  } else {
    TORCH_INTERNAL_ASSERT(storage->allocator() != nullptr, "storage without an allocator");
    memory::UntrackedAllocationScope untracked;  // counted below as a buffer in flight
    storage->set_data_ptr_noswap(storage->allocator()->allocate(capacity_bytes_));
  }
  storage->set_nbytes(static_cast<size_t>(capacity_bytes_));
  memory::note_comm_buffer_bytes(storage->device(), capacity_bytes_);
}

void ReleasableBuffer::release() {
  if (!allocated() || capacity_bytes_ == 0) return;
  c10::StorageImpl* storage = flat_.storage().unsafeGetStorageImpl();
  // Dropping the old DataPtr frees the memory (its deleter returns it to the block cache or the
  // allocator).
  {
    memory::UntrackedAllocationScope untracked;
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  }
  storage->set_nbytes(0);
  memory::note_comm_buffer_bytes(storage->device(), -capacity_bytes_);
}

torch::Tensor ReleasableBuffer::alias(int64_t offset, c10::IntArrayRef sizes) const {
  TORCH_CHECK(allocated(), "ReleasableBuffer::alias needs allocated memory");
  const int64_t numel = c10::multiply_integers(sizes);
  TORCH_CHECK(offset >= 0 && offset + numel <= flat_.numel(), "alias [", offset, ", ",
              offset + numel, ") outside a buffer of ", flat_.numel(), " elements");
  torch::NoGradGuard no_grad;
  torch::Tensor out = torch::empty({0}, flat_.options());
  out.set_(flat_.storage(), flat_.storage_offset() + offset, sizes,
           c10::contiguous_strides(sizes));
  return out;
}

// ---------------------------------------------------------------------------------------------
// DistributedBuffer

DistributedBuffer::DistributedBuffer(Plan plan, int64_t rank, c10::ScalarType sharded_dtype,
                                     c10::ScalarType unsharded_dtype, c10::Device device)
    : plan_(std::move(plan)), rank_(rank) {
  validate_plan(plan_);
  LOOM_REQUIRE(rank_ >= 0 && rank_ < plan_.world_size, "DistributedBuffer for group '",
               plan_.group, "': rank ", rank_, " is outside its ", plan_.world_size, " ranks");
  const int64_t S = plan_.shard_elems;
  const int64_t W = plan_.world_size;
  const size_t n = plan_.tensors.size();
  local_ranges_.resize(n);
  global_ranges_.resize(n);
  pieces_.resize(n);
  split_offset_.assign(n, -1);
  int64_t side_numel = 0;
  for (size_t i = 0; i < n; ++i) {
    const TensorLayout& t = plan_.tensors[i];
    const int64_t granule = t.shard.granule_elems;
    // The tensor's units fill ranks in order: from `offset` on its first rank, from local offset 0
    // on the following ones (see TensorLayout).
    bool first = true;
    for (int64_t r = 0; r < W; ++r) {
      const int64_t units = t.shard.units_per_rank[static_cast<size_t>(r)];
      if (units == 0) continue;
      const int64_t local_begin = first ? t.offset - r * S : 0;
      first = false;
      pieces_[i].push_back({r * S + local_begin, units * granule});
      if (r == rank_) local_ranges_[i] = {local_begin, local_begin + units * granule};
    }
    global_ranges_[i] = t.shard.rank_range(rank_);
    if (!plan_.contiguous(i)) {
      split_offset_[i] = side_numel;
      side_numel += t.numel;
    }
  }
  const auto sharded_options = torch::TensorOptions().dtype(sharded_dtype).device(device);
  const auto unsharded_options = torch::TensorOptions().dtype(unsharded_dtype).device(device);
  sharded_ = torch::zeros({S}, sharded_options);
  unsharded_ = ReleasableBuffer(W * S, unsharded_options);
  side_ = ReleasableBuffer(side_numel, unsharded_options);
  release_unsharded();
}

torch::Tensor DistributedBuffer::sharded_view(size_t i) const {
  TORCH_CHECK(i < num_tensors(), "tensor index ", i, " out of range");
  const tensor::FlatRange local = local_ranges_[i];
  torch::Tensor flat = sharded_.narrow(0, local.begin, local.size());
  const TensorLayout& t = plan_.tensors[i];
  if (auto shape = t.shard.local_shape(rank_, t.shape)) return flat.view(*shape);
  return flat;
}

void DistributedBuffer::write_shard_from_full(size_t i, const torch::Tensor& full) {
  TORCH_CHECK(i < num_tensors(), "tensor index ", i, " out of range");
  const TensorLayout& t = plan_.tensors[i];
  LOOM_REQUIRE(full.sizes().vec() == t.shape, "tensor '", t.name, "' of FSDP group '",
               plan_.group, "' has shape ", tensor::shape_str(t.shape), ", got a value of shape ",
               full.sizes());
  const tensor::FlatRange local = local_ranges_[i];
  const tensor::FlatRange global = global_ranges_[i];
  if (local.empty()) return;
  torch::NoGradGuard no_grad;
  sharded_.narrow(0, local.begin, local.size())
      .copy_(full.detach().reshape({-1}).narrow(0, global.begin, global.size()));
}

void DistributedBuffer::allocate_unsharded() {
  unsharded_.allocate();
  side_.allocate();
}

void DistributedBuffer::zero_unsharded() {
  TORCH_CHECK(unsharded_allocated(), "zero_unsharded needs the unsharded buffer allocated");
  unsharded_.flat().zero_();
  if (side_.numel() > 0) side_.flat().zero_();
}

void DistributedBuffer::release_unsharded() {
  unsharded_.release();
  side_.release();
}

torch::Tensor DistributedBuffer::unsharded_rank_slice() const {
  return unsharded_.flat().narrow(0, rank_ * plan_.shard_elems, plan_.shard_elems);
}

torch::Tensor DistributedBuffer::unsharded_view(size_t i) const {
  TORCH_CHECK(i < num_tensors(), "tensor index ", i, " out of range");
  const TensorLayout& t = plan_.tensors[i];
  if (is_split(i)) return side_.flat().narrow(0, split_offset_[i], t.numel).view(t.shape);
  return unsharded_.flat().narrow(0, t.offset, t.numel).view(t.shape);
}

torch::Tensor DistributedBuffer::unsharded_alias(size_t i) const {
  TORCH_CHECK(i < num_tensors(), "tensor index ", i, " out of range");
  const TensorLayout& t = plan_.tensors[i];
  if (is_split(i)) return side_.alias(split_offset_[i], t.shape);
  return unsharded_.alias(t.offset, t.shape);
}

int64_t DistributedBuffer::num_split_tensors() const {
  int64_t n = 0;
  for (int64_t off : split_offset_) n += off >= 0;
  return n;
}

void DistributedBuffer::copy_out_split_tensors() {
  if (side_.numel() == 0) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor& flat = unsharded_.flat();
  for (size_t i = 0; i < num_tensors(); ++i) {
    if (!is_split(i)) continue;
    int64_t at = split_offset_[i];
    for (const Piece& p : pieces_[i]) {
      side_.flat().narrow(0, at, p.length).copy_(flat.narrow(0, p.buffer_begin, p.length));
      at += p.length;
    }
  }
}

void DistributedBuffer::copy_in_split_tensors() {
  if (side_.numel() == 0) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor& flat = unsharded_.flat();
  for (size_t i = 0; i < num_tensors(); ++i) {
    if (!is_split(i)) continue;
    int64_t at = split_offset_[i];
    for (const Piece& p : pieces_[i]) {
      flat.narrow(0, p.buffer_begin, p.length).copy_(side_.flat().narrow(0, at, p.length));
      at += p.length;
    }
  }
}

torch::Tensor DistributedBuffer::full_from_gathered(size_t i, const torch::Tensor& gathered) const {
  TORCH_CHECK(i < num_tensors(), "tensor index ", i, " out of range");
  LOOM_REQUIRE(gathered.dim() == 1 && gathered.numel() == plan_.buffer_elems(),
               "FSDP group '", plan_.group, "': a gathered buffer must be flat with ",
               plan_.buffer_elems(), " elements, got shape ", gathered.sizes());
  const TensorLayout& t = plan_.tensors[i];
  torch::Tensor out = torch::empty({t.numel}, gathered.options());
  int64_t at = 0;
  for (const Piece& p : pieces_[i]) {
    out.narrow(0, at, p.length).copy_(gathered.narrow(0, p.buffer_begin, p.length));
    at += p.length;
  }
  return out.view(t.shape);
}

int64_t DistributedBuffer::allocated_bytes() const {
  int64_t bytes = static_cast<int64_t>(sharded_.nbytes());
  if (unsharded_.allocated()) bytes += unsharded_.capacity_bytes() + side_.capacity_bytes();
  return bytes;
}

}  // namespace loom::fsdp
