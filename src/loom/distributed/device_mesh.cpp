#include "loom/distributed/device_mesh.h"

#include <algorithm>
#include <set>

#include "loom/core/error.h"

namespace loom::distributed {
namespace {

std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", " : "") + items[i];
  return s;
}

}  // namespace

MeshLayout::MeshLayout(std::vector<std::string> dim_names, std::vector<int> dim_sizes)
    : names_(std::move(dim_names)), sizes_(std::move(dim_sizes)) {
  LOOM_REQUIRE(names_.size() == sizes_.size(), "device mesh has ", names_.size(),
               " dim names but ", sizes_.size(), " sizes");
  std::set<std::string> seen;
  for (size_t i = 0; i < names_.size(); ++i) {
    LOOM_REQUIRE(!names_[i].empty(), "device mesh dim ", i, " has an empty name");
    LOOM_REQUIRE(seen.insert(names_[i]).second, "device mesh dim name '", names_[i],
                 "' appears twice in (", join(names_), ")");
    LOOM_REQUIRE(sizes_[i] >= 1, "device mesh dim '", names_[i], "' has size ", sizes_[i],
                 "; sizes must be >= 1");
  }
  strides_.assign(sizes_.size(), 1);
  for (int i = ndim() - 2; i >= 0; --i) strides_[i] = strides_[i + 1] * sizes_[i + 1];
  for (int s : sizes_) world_size_ *= s;
}

bool MeshLayout::has_dim(const std::string& name) const {
  return std::find(names_.begin(), names_.end(), name) != names_.end();
}

int MeshLayout::dim_index(const std::string& name) const {
  auto it = std::find(names_.begin(), names_.end(), name);
  LOOM_REQUIRE(it != names_.end(), "device mesh has no dim '", name, "' (dims: ",
               names_.empty() ? std::string("none") : join(names_), ")");
  return static_cast<int>(it - names_.begin());
}

int MeshLayout::size(const std::string& dim) const { return sizes_[dim_index(dim)]; }

std::vector<int> MeshLayout::coordinates(int rank) const {
  LOOM_REQUIRE(rank >= 0 && rank < world_size_, "rank ", rank, " is outside the mesh of ",
               world_size_, " ranks");
  std::vector<int> c(ndim());
  for (int i = 0; i < ndim(); ++i) c[i] = (rank / strides_[i]) % sizes_[i];
  return c;
}

int MeshLayout::rank_at(const std::vector<int>& coordinates) const {
  LOOM_REQUIRE(static_cast<int>(coordinates.size()) == ndim(), "mesh coordinates have ",
               coordinates.size(), " entries, the mesh has ", ndim(), " dims");
  int rank = 0;
  for (int i = 0; i < ndim(); ++i) {
    LOOM_REQUIRE(coordinates[i] >= 0 && coordinates[i] < sizes_[i], "mesh coordinate ",
                 coordinates[i], " is outside dim '", names_[i], "' of size ", sizes_[i]);
    rank += coordinates[i] * strides_[i];
  }
  return rank;
}

std::vector<int> MeshLayout::dim_indices(const std::vector<std::string>& dims) const {
  std::vector<int> idx;
  for (const auto& d : dims) {
    const int i = dim_index(d);
    LOOM_REQUIRE(idx.empty() || i > idx.back(), "mesh dims (", join(dims),
                 ") must be distinct and in mesh order (", join(names_), ")");
    idx.push_back(i);
  }
  return idx;
}

std::vector<int> MeshLayout::group_ranks(int rank, const std::vector<std::string>& dims) const {
  const std::vector<int> idx = dim_indices(dims);
  std::vector<int> coords = coordinates(rank);
  int group_size = 1;
  for (int i : idx) group_size *= sizes_[i];
  std::vector<int> ranks;
  ranks.reserve(group_size);
  for (int g = 0; g < group_size; ++g) {
    // Decompose g row-major over the selected dims (last one fastest).
    int rest = g;
    for (int k = static_cast<int>(idx.size()) - 1; k >= 0; --k) {
      coords[idx[k]] = rest % sizes_[idx[k]];
      rest /= sizes_[idx[k]];
    }
    ranks.push_back(rank_at(coords));
  }
  return ranks;
}

int MeshLayout::local_rank(int rank, const std::vector<std::string>& dims) const {
  const std::vector<int> idx = dim_indices(dims);
  const std::vector<int> coords = coordinates(rank);
  int local = 0;
  for (int i : idx) local = local * sizes_[i] + coords[i];
  return local;
}

std::vector<std::vector<int>> MeshLayout::all_groups(const std::vector<std::string>& dims) const {
  std::vector<std::vector<int>> groups;
  std::vector<bool> covered(world_size_, false);
  for (int r = 0; r < world_size_; ++r) {
    if (covered[r]) continue;
    groups.push_back(group_ranks(r, dims));
    for (int m : groups.back()) covered[m] = true;
  }
  return groups;
}

std::string MeshLayout::describe() const {
  if (names_.empty()) return "single rank";
  std::string s;
  for (int i = 0; i < ndim(); ++i) s += c10::str(i ? " x " : "", names_[i], "=", sizes_[i]);
  return s;
}

DeviceMesh::DeviceMesh(std::shared_ptr<Distributed> dist, std::vector<std::string> dim_names,
                       std::vector<int> dim_sizes)
    : dist_(std::move(dist)), layout_(std::move(dim_names), std::move(dim_sizes)) {
  LOOM_REQUIRE(dist_ != nullptr, "DeviceMesh needs an initialized Distributed context");
  LOOM_REQUIRE(layout_.world_size() == dist_->world_size(), "device mesh ", layout_.describe(),
               " has ", layout_.world_size(), " ranks but the world has ", dist_->world_size());
  for (const auto& name : layout_.dim_names()) {
    const auto ranks = layout_.group_ranks(rank(), {name});
    entries_.emplace(name, Entry{{name}, dist_->new_group(ranks, name)});
  }
}

void DeviceMesh::flatten(const std::vector<std::string>& dims, const std::string& name) {
  LOOM_REQUIRE(!dims.empty(), "flattened mesh dim '", name, "' needs at least one dim");
  LOOM_REQUIRE(!name.empty(), "flattened mesh dim of (", join(dims), ") needs a name");
  LOOM_REQUIRE(!has(name), "mesh dim name '", name, "' is already registered");
  const auto ranks = layout_.group_ranks(rank(), dims);
  entries_.emplace(name, Entry{dims, dist_->new_group(ranks, name)});
  flattened_.push_back(name);
}

void DeviceMesh::add_view(const MeshLayout& view) {
  LOOM_REQUIRE(view.world_size() == layout_.world_size(), "mesh view ", view.describe(), " has ",
               view.world_size(), " ranks but the mesh has ", layout_.world_size());
  for (const auto& name : view.dim_names()) {
    if (has(name)) {
      LOOM_REQUIRE(group_ranks(name) == view.group_ranks(rank(), {name}), "mesh view ", view.describe(),
                   " gives dim '", name, "' other ranks than the mesh ", layout_.describe());
      continue;
    }
    entries_.emplace(name, Entry{{name}, dist_->new_group(view.group_ranks(rank(), {name}), name)});
    flattened_.push_back(name);
  }
}

bool DeviceMesh::has(const std::string& name) const { return entries_.count(name) > 0; }

const DeviceMesh::Entry& DeviceMesh::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    std::vector<std::string> known;
    for (const auto& [n, e] : entries_) known.push_back(n);
    fail("device mesh has no dim '", name, "' (known: ",
         known.empty() ? std::string("none") : join(known), ")");
  }
  return it->second;
}

int DeviceMesh::size(const std::string& name) const { return entry(name).comm->size(); }

int DeviceMesh::local_rank(const std::string& name) const { return entry(name).comm->rank(); }

const std::shared_ptr<Comm>& DeviceMesh::comm(const std::string& name) const {
  return entry(name).comm;
}

std::vector<int> DeviceMesh::group_ranks(const std::string& name) const {
  return entry(name).comm->world_ranks();
}

std::vector<std::string> DeviceMesh::flattened_names() const { return flattened_; }

}  // namespace loom::distributed
