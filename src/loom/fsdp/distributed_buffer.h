// The flat buffers of one FSDP group, laid out by the planner (planner.h).
//
// A group's tensors live in one flat buffer of W·S elements; rank r owns [r·S, (r+1)·S). A
// DistributedBuffer holds this rank's persistent shard of S elements and the releasable unsharded
// buffer of W·S elements that an all-gather fills (or a reduce-scatter drains). Every tensor of the
// group is a view: its sharded piece into the shard, its unsharded value into the unsharded buffer,
// so collectives run on whole buffers and nothing is copied per parameter.
//
// One exception comes from the plan itself: when a tensor's granules do not fill the end of a rank
// (row or block granularity), the planner leaves padding *between* the tensor's pieces, and the
// unsharded tensor is no longer one run of the buffer (Plan::contiguous is false). Such "split"
// tensors — at most W − 1 per group, none at element granularity — get their unsharded value in a
// small side buffer, assembled from the pieces after an all-gather and scattered back before a
// reduce-scatter (copy_out_split_tensors / copy_in_split_tensors).
//
// Releasing memory while views live: FSDP frees the unsharded buffer after forward although
// autograd's saved tensors (and the module) still hold views of it. ReleasableBuffer hands the
// storage's memory back to the allocator and installs fresh memory later into the *same*
// StorageImpl, so every view made before sees the new memory (PyTorch FSDP2 does the same with
// untyped_storage().resize_(0) / resize_(n)). On CPU the memory goes to a per-size cache rather
// than to malloc: every block's buffer has the same size, so the next group reuses resident pages,
// and glibc's heap never sees these tens-of-MiB chunks (see BlockCache in the .cpp). On a GPU the
// device's caching allocator already does that: released memory goes back to its pool, and the
// next group's buffer of the same size takes it again.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "loom/fsdp/planner.h"

namespace loom::fsdp {

class BlockCache;

// A flat 1-D tensor whose memory can be released and re-allocated while tensors viewing it stay
// valid objects. Reading a view while released is a bug (its storage holds no memory). On CPU the
// memory comes from a cache shared by all buffers of the same size (distributed_buffer.cpp):
// release() hands it to the next buffer of that size instead of back to the system, and the cache
// unmaps it when the last buffer of that size is destroyed.
class ReleasableBuffer {
 public:
  ReleasableBuffer() = default;
  // Allocated, uninitialized.
  ReleasableBuffer(int64_t numel, const torch::TensorOptions& options);
  // Its memory is a communication buffer in memory::AllocationTracker's accounts (reported by
  // allocate / release), so moves hand the account over and destruction closes it.
  ReleasableBuffer(ReleasableBuffer&& other) noexcept;
  ReleasableBuffer& operator=(ReleasableBuffer&& other) noexcept;
  ~ReleasableBuffer();

  const torch::Tensor& flat() const { return flat_; }
  int64_t numel() const { return flat_.defined() ? flat_.numel() : 0; }
  int64_t capacity_bytes() const { return capacity_bytes_; }
  bool allocated() const;
  // Installs fresh, uninitialized memory (no-op when allocated).
  void allocate();
  // Hands the memory back to the allocator (no-op when released). Callers must make sure no
  // kernel or collective still uses it.
  void release();
  // A tensor of `sizes` (contiguous) over elements [offset, offset + numel) of this buffer with its
  // own TensorImpl and version counter: writes through flat() (collectives) do not bump its
  // version, so autograd accepts it as a saved leaf across a re-gather. Needs allocated().
  torch::Tensor alias(int64_t offset, c10::IntArrayRef sizes) const;

 private:
  torch::Tensor flat_;
  int64_t capacity_bytes_ = 0;
  std::shared_ptr<BlockCache> cache_;  // CPU only
};

class DistributedBuffer {
 public:
  // `rank` is this process's index among the plan's W ranks. The shard (dtype `sharded_dtype`) is
  // zero-filled; the unsharded buffer (dtype `unsharded_dtype`) starts released.
  DistributedBuffer(Plan plan, int64_t rank, c10::ScalarType sharded_dtype,
                    c10::ScalarType unsharded_dtype, c10::Device device = torch::kCPU);

  const Plan& plan() const { return plan_; }
  int64_t rank() const { return rank_; }
  int64_t world_size() const { return plan_.world_size; }
  int64_t shard_numel() const { return plan_.shard_elems; }  // S
  size_t num_tensors() const { return plan_.tensors.size(); }

  // ---- Sharded: this rank's S elements, persistent; padding stays zero. ----
  const torch::Tensor& sharded() const { return sharded_; }
  // Tensor i's piece on this rank, a view of sharded(): shaped [rows, trailing...] when it holds
  // whole rows (see RaggedShard::local_shape), else flat. Empty when the rank holds none of it.
  torch::Tensor sharded_view(size_t i) const;
  // Where tensor i's piece sits: elements [begin, end) of sharded(), and the flat row-major
  // elements of the full tensor it holds (same length).
  tensor::FlatRange local_range(size_t i) const { return local_ranges_[i]; }
  tensor::FlatRange global_range(size_t i) const { return global_ranges_[i]; }
  // Writes this rank's piece of tensor i from its full value (any dtype; converted).
  void write_shard_from_full(size_t i, const torch::Tensor& full);
  // Frees the sharded storage for good (sharded() becomes empty; views taken before must not be
  // used): a frozen group's gradient buffer, into which nothing is ever reduced.
  void drop_sharded() { sharded_ = torch::empty({0}, sharded_.options()); }

  // ---- Unsharded: W·S elements, released between uses. ----
  const torch::Tensor& unsharded() const { return unsharded_.flat(); }
  bool unsharded_allocated() const { return unsharded_.allocated(); }
  // Allocates the unsharded buffer and the split tensors' side buffer (uninitialized).
  void allocate_unsharded();
  // Fills the allocated unsharded and side buffers with zeros (padding included).
  void zero_unsharded();
  void release_unsharded();
  // This rank's S elements of the unsharded buffer: the all-gather send buffer when gathering in
  // place, and where this rank's share of a reduce-scatter comes from.
  torch::Tensor unsharded_rank_slice() const;
  // Tensor i's full-shape unsharded value: a view of the unsharded buffer, or of the side buffer
  // for a split tensor. Valid while allocated; shares the buffer's version counter.
  torch::Tensor unsharded_view(size_t i) const;
  // Same memory as unsharded_view(i) with an independent TensorImpl (ReleasableBuffer::alias).
  torch::Tensor unsharded_alias(size_t i) const;
  bool is_split(size_t i) const { return split_offset_[i] >= 0; }
  int64_t num_split_tensors() const;
  // After an all-gather: assemble each split tensor from its pieces into the side buffer.
  void copy_out_split_tensors();
  // Before a reduce-scatter: write each split tensor's side-buffer value back to its pieces.
  void copy_in_split_tensors();
  // Tensor i's full value (a new tensor of its shape) out of a gathered W·S flat buffer laid out
  // by this plan (any dtype): what full-state-dict gathering uses.
  torch::Tensor full_from_gathered(size_t i, const torch::Tensor& gathered) const;

  // Bytes held now: the shard plus whatever unsharded memory is allocated.
  int64_t allocated_bytes() const;

 private:
  struct Piece {
    int64_t buffer_begin;  // flat index in the W·S buffer
    int64_t length;
  };

  Plan plan_;
  int64_t rank_;
  torch::Tensor sharded_;
  ReleasableBuffer unsharded_;
  ReleasableBuffer side_;  // split tensors' unsharded values, back to back
  std::vector<tensor::FlatRange> local_ranges_;
  std::vector<tensor::FlatRange> global_ranges_;
  std::vector<std::vector<Piece>> pieces_;  // per tensor, in rank order
  std::vector<int64_t> split_offset_;       // offset in side_, or -1 when contiguous
};

}  // namespace loom::fsdp
