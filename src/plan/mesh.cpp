#include "scaletrain/mesh.h"

#include <set>
#include <utility>

#include "scaletrain/error.h"

namespace scaletrain {

DeviceMesh::DeviceMesh(std::vector<MeshDim> dims, int world_size)
    : dims_(std::move(dims)), world_size_(world_size) {
  if (dims_.empty()) throw UsageError("a device mesh needs at least one dimension");
  std::set<std::string> names;
  long product = 1;
  for (const auto& d : dims_) {
    if (d.name.empty()) throw UsageError("a device mesh's dimensions need names, e.g. dp or pp");
    if (!names.insert(d.name).second) {
      throw UsageError("the device mesh names dimension '" + d.name + "' twice");
    }
    if (d.size < 1) {
      throw UsageError("mesh dimension '" + d.name + "' has size " + std::to_string(d.size) +
                       "; every dimension needs at least 1");
    }
    product *= d.size;
  }
  strides_.assign(dims_.size(), 1);
  for (int i = ndim() - 2; i >= 0; --i) {
    strides_[static_cast<size_t>(i)] =
        strides_[static_cast<size_t>(i) + 1] * dims_[static_cast<size_t>(i) + 1].size;
  }
  if (product != world_size) {
    throw UsageError("the device mesh " + describe() + " has " + std::to_string(product) +
                     " ranks, and the world has " + std::to_string(world_size) +
                     ": make the sizes' product the world size");
  }
}

int DeviceMesh::index_of(const std::string& name) const {
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].name == name) return static_cast<int>(i);
  }
  throw UsageError("the device mesh " + describe() + " has no dimension '" + name + "'");
}

void DeviceMesh::check_rank(int rank) const {
  if (rank < 0 || rank >= world_size_) {
    throw UsageError("rank " + std::to_string(rank) + " is outside the device mesh " + describe() +
                     " (ranks 0-" + std::to_string(world_size_ - 1) + ")");
  }
}

int DeviceMesh::size(const std::string& name) const {
  return dims_[static_cast<size_t>(index_of(name))].size;
}

bool DeviceMesh::has(const std::string& name) const {
  for (const auto& d : dims_) {
    if (d.name == name) return true;
  }
  return false;
}

std::vector<int> DeviceMesh::coordinates(int rank) const {
  check_rank(rank);
  std::vector<int> out;
  for (size_t i = 0; i < dims_.size(); ++i) out.push_back(rank / strides_[i] % dims_[i].size);
  return out;
}

int DeviceMesh::coordinate(int rank, const std::string& name) const {
  return coordinates(rank)[static_cast<size_t>(index_of(name))];
}

int DeviceMesh::rank_at(const std::vector<int>& c) const {
  if (c.size() != dims_.size()) {
    throw UsageError("the device mesh " + describe() + " takes " + std::to_string(ndim()) +
                     " coordinates, got " + std::to_string(c.size()));
  }
  int rank = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (c[i] < 0 || c[i] >= dims_[i].size) {
      throw UsageError("coordinate " + std::to_string(c[i]) + " is outside mesh dimension '" +
                       dims_[i].name + "' of size " + std::to_string(dims_[i].size));
    }
    rank += c[i] * strides_[i];
  }
  return rank;
}

std::vector<int> DeviceMesh::group(int rank, const std::string& name) const {
  const auto i = static_cast<size_t>(index_of(name));
  auto c = coordinates(rank);
  std::vector<int> out;
  for (int k = 0; k < dims_[i].size; ++k) {
    c[i] = k;
    out.push_back(rank_at(c));
  }
  return out;
}

std::vector<std::vector<int>> DeviceMesh::groups(const std::string& name) const {
  const auto i = static_cast<size_t>(index_of(name));
  std::vector<std::vector<int>> out;
  for (int rank = 0; rank < world_size_; ++rank) {
    if (coordinates(rank)[i] == 0) out.push_back(group(rank, name));
  }
  return out;
}

std::string DeviceMesh::describe() const {
  std::string out;
  for (const auto& d : dims_) {
    out += (out.empty() ? "" : " x ") + d.name + "=" + std::to_string(d.size);
  }
  return out;
}

}  // namespace scaletrain
