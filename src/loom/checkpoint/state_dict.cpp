#include "loom/checkpoint/state_dict.h"
#include "loom/core/strings.h"

#include <algorithm>

#include "loom/core/error.h"

namespace loom::checkpoint {
namespace {

int64_t numel_of(const std::string& name, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) {
    LOOM_REQUIRE(d >= 0, "tensor '", name, "' has a negative dimension in shape ", shape_text(shape));
    n *= d;
  }
  return n;
}

}  // namespace

int64_t ShardedTensor::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

ShardedTensor& ShardedStateDict::add_chunks(const std::string& name, const std::string& component,
                                            std::vector<int64_t> global_shape,
                                            c10::ScalarType dtype, std::vector<LocalChunk> chunks) {
  LOOM_REQUIRE(!name.empty(), "a checkpointed tensor needs a name");
  LOOM_REQUIRE(name.find('@') == std::string::npos, "tensor name '", name,
               "' contains '@', which checkpoint files use to separate name and offset");
  LOOM_REQUIRE(!component.empty(), "tensor '", name, "' needs a component (e.g. \"model\")");
  LOOM_REQUIRE(!tensors_.count(name), "tensor '", name, "' was added to the state dict twice");
  numel_of(name, global_shape);  // rejects negative dims
  for (const LocalChunk& c : chunks) {
    LOOM_REQUIRE(c.data.defined() && !c.data.is_meta(), "tensor '", name, "': the chunk ",
                 describe(c.region()), " has no data (undefined or on the meta device)");
    LOOM_REQUIRE(c.data.scalar_type() == dtype, "tensor '", name, "': the chunk ", describe(c.region()),
                 " is ", c10::toString(c.data.scalar_type()), " but the tensor is declared ",
                 c10::toString(dtype));
    const std::string error = region_error(global_shape, c.region());
    LOOM_REQUIRE(error.empty(), "tensor '", name, "' of shape ", shape_text(global_shape), ": chunk ",
                 describe(c.region()), ": ", error);
  }
  // Empty chunks carry nothing; dropping them keeps "which rank holds what" unambiguous.
  std::erase_if(chunks, [](const LocalChunk& c) { return c.data.numel() == 0; });
  std::sort(chunks.begin(), chunks.end(),
            [](const LocalChunk& a, const LocalChunk& b) { return a.region() < b.region(); });
  // No element twice on one rank: the chunks' global runs, in order, must not overlap.
  struct Owned {
    Run run;
    size_t chunk;
  };
  std::vector<Owned> owned;
  for (size_t i = 0; i < chunks.size(); ++i) {
    for (const Run& r : runs_of(global_shape, chunks[i].region())) owned.push_back({r, i});
  }
  std::sort(owned.begin(), owned.end(), [](const Owned& a, const Owned& b) { return a.run.global < b.run.global; });
  for (size_t i = 1; i < owned.size(); ++i) {
    LOOM_REQUIRE(owned[i].run.global >= owned[i - 1].run.global + owned[i - 1].run.length, "tensor '",
                 name, "': chunks ", describe(chunks[owned[i - 1].chunk].region()), " and ",
                 describe(chunks[owned[i].chunk].region()), " overlap on this rank");
  }
  ShardedTensor t;
  t.component = component;
  t.shape = std::move(global_shape);
  t.dtype = dtype;
  t.chunks = std::move(chunks);
  return tensors_.emplace(name, std::move(t)).first->second;
}

ShardedTensor& ShardedStateDict::add_full(const std::string& name, const std::string& component,
                                          const torch::Tensor& tensor) {
  LOOM_REQUIRE(tensor.defined(), "tensor '", name, "' is undefined");
  return add_chunks(name, component, tensor.sizes().vec(), tensor.scalar_type(), {{0, tensor}});
}

ShardedTensor& ShardedStateDict::add_box(const std::string& name, const std::string& component,
                                         std::vector<int64_t> global_shape,
                                         std::vector<int64_t> box_offsets, const torch::Tensor& local) {
  LOOM_REQUIRE(local.defined(), "tensor '", name, "' is undefined");
  LOOM_REQUIRE(local.dim() == static_cast<int64_t>(global_shape.size()), "tensor '", name, "': a box of shape ",
               shape_text(local.sizes().vec()), " does not have the dims of ", shape_text(global_shape));
  // A box that is the whole tensor is stored as such (the format FSDP and replicas use).
  if (local.sizes().vec() == global_shape) return add_full(name, component, local);
  LocalChunk chunk{0, local, std::move(box_offsets), local.sizes().vec()};
  return add_chunks(name, component, std::move(global_shape), local.scalar_type(), {std::move(chunk)});
}

ShardedTensor& ShardedStateDict::add_shard0(const std::string& name, const std::string& component,
                                            std::vector<int64_t> global_shape, int64_t row_offset,
                                            const torch::Tensor& local) {
  LOOM_REQUIRE(local.defined(), "tensor '", name, "' is undefined");
  LOOM_REQUIRE(!global_shape.empty() && local.dim() == static_cast<int64_t>(global_shape.size()),
               "tensor '", name, "': a Shard(0) piece of shape ", shape_text(local.sizes().vec()),
               " does not match the global shape ", shape_text(global_shape));
  int64_t row = 1;
  for (size_t d = 1; d < global_shape.size(); ++d) {
    LOOM_REQUIRE(local.size(static_cast<int64_t>(d)) == global_shape[d], "tensor '", name,
                 "': a Shard(0) piece of shape ", shape_text(local.sizes().vec()),
                 " differs from the global shape ", shape_text(global_shape), " beyond dim 0");
    row *= global_shape[d];
  }
  LOOM_REQUIRE(row_offset >= 0 && row_offset + local.size(0) <= global_shape[0], "tensor '", name,
               "': rows [", row_offset, ", ", row_offset + local.size(0), ") exceed dim 0 of ",
               shape_text(global_shape));
  return add_chunks(name, component, std::move(global_shape), local.scalar_type(),
                    {{row_offset * row, local}});
}

const ShardedTensor& ShardedStateDict::at(const std::string& name) const {
  const auto it = tensors_.find(name);
  LOOM_REQUIRE(it != tensors_.end(), "tensor '", name, "' is not in the state dict");
  return it->second;
}

ShardedStateDict ShardedStateDict::only(const std::string& component) const {
  ShardedStateDict out;
  for (const auto& [name, t] : tensors_) {
    if (t.component == component) out.tensors_.emplace(name, t);
  }
  out.json_ = json_;
  out.rank_json_ = rank_json_;
  return out;
}

int64_t ShardedStateDict::local_bytes() const {
  int64_t bytes = 0;
  for (const auto& [name, t] : tensors_) {
    for (const LocalChunk& c : t.chunks) bytes += c.data.numel() * c.data.element_size();
  }
  return bytes;
}

}  // namespace loom::checkpoint
