// A named n-D mesh of world ranks, laid out row-major (the last dim varies fastest), with one
// communication group per dim and per flattened dim. MeshLayout is the pure rank arithmetic (no
// processes needed); DeviceMesh adds the groups this rank belongs to, created once.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/distributed/comm.h"
#include "loom/distributed/process_group.h"

namespace loom::distributed {

class MeshLayout {
 public:
  // Zero dims describe a one-rank world.
  MeshLayout(std::vector<std::string> dim_names, std::vector<int> dim_sizes);

  int ndim() const { return static_cast<int>(names_.size()); }
  int world_size() const { return world_size_; }
  const std::vector<std::string>& dim_names() const { return names_; }
  const std::vector<int>& dim_sizes() const { return sizes_; }
  bool has_dim(const std::string& name) const;
  int dim_index(const std::string& name) const;  // throws naming the known dims
  int size(const std::string& dim) const;

  std::vector<int> coordinates(int rank) const;
  int rank_at(const std::vector<int>& coordinates) const;
  // `dims` must be distinct and in mesh order. The group of `rank` over `dims` holds the ranks that
  // share all of `rank`'s other coordinates, ordered row-major over `dims`.
  std::vector<int> group_ranks(int rank, const std::vector<std::string>& dims) const;
  // This rank's index in its group over `dims`.
  int local_rank(int rank, const std::vector<std::string>& dims) const;
  // The groups over `dims` partitioning the world, ordered by their first rank.
  std::vector<std::vector<int>> all_groups(const std::vector<std::string>& dims) const;
  std::string describe() const;  // "pp=2 x dp_shard=2 x tp=2"

 private:
  std::vector<int> dim_indices(const std::vector<std::string>& dims) const;

  std::vector<std::string> names_;
  std::vector<int> sizes_;
  std::vector<int> strides_;
  int world_size_ = 1;
};

class DeviceMesh {
 public:
  // Creates this rank's group along every dim (in dim order, so all ranks agree on the creation
  // order). The dims' product must equal the world size.
  DeviceMesh(std::shared_ptr<Distributed> dist, std::vector<std::string> dim_names,
             std::vector<int> dim_sizes);

  // Registers `name` as the flattening of `dims` (distinct, in mesh order) and creates its group.
  // Every rank must register the same flattenings in the same order.
  void flatten(const std::vector<std::string>& dims, const std::string& name);
  // Registers the dims of `view`, another row-major layout of the same world (TorchTitan's sparse
  // mesh for experts: (pp, dp_replicate, efsdp, ep) beside (pp, dp_replicate, dp_shard, cp, tp)),
  // each with its group, under its own name; names already registered (dims the two layouts share)
  // keep their groups. A dim of size 1 gets a group of this rank alone. Every rank must call it
  // with the same view.
  void add_view(const MeshLayout& view);

  // Names below are real dims or flattened ones.
  bool has(const std::string& name) const;
  int size(const std::string& name) const;
  int local_rank(const std::string& name) const;
  const std::shared_ptr<Comm>& comm(const std::string& name) const;
  std::vector<int> group_ranks(const std::string& name) const;
  std::vector<std::string> flattened_names() const;

  const MeshLayout& layout() const { return layout_; }
  int rank() const { return dist_->rank(); }
  int world_size() const { return dist_->world_size(); }
  const std::shared_ptr<Distributed>& dist() const { return dist_; }

 private:
  struct Entry {
    std::vector<std::string> dims;  // one for a real dim, several for a flattened one
    std::shared_ptr<Comm> comm;
  };
  const Entry& entry(const std::string& name) const;

  std::shared_ptr<Distributed> dist_;
  MeshLayout layout_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> flattened_;
};

}  // namespace loom::distributed
