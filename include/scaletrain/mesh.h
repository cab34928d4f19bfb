#pragma once
// DeviceMesh: the ranks of a job laid out on named dimensions, as PyTorch's init_device_mesh
// lays them out: {"dp": 2, "pp": 2} over 4 ranks is a 2 x 2 grid in row-major order (the last
// dimension varies fastest), so rank = dp · 2 + pp:
//
//            pp 0    pp 1
//   dp 0     rank 0  rank 1
//   dp 1     rank 2  rank 3
//
// A rank's coordinates name its place on every dimension; its group along a dimension is the
// ranks that share all its other coordinates (rank 1's "dp" group: {1, 3}; its "pp" group:
// {0, 1}). A parallel dimension of a strategy is one name here: data parallel averages over the
// "dp" group, a pipeline passes activations along the "pp" group, tensor parallelism would
// split layers over a "tp" group. mesh_groups() (dist.h) makes each group a process group.
//
// A pure description: no process group, no LibTorch. Thread-safe (immutable).

#include <string>
#include <vector>

namespace scaletrain {

struct MeshDim {
  std::string name;
  int size = 1;
};

class DeviceMesh {
 public:
  /// Dimensions outermost first. Throws UsageError naming the fix when a size is below 1, a
  /// name is empty or repeated, or the sizes' product is not `world_size`.
  DeviceMesh(std::vector<MeshDim> dims, int world_size);

  const std::vector<MeshDim>& dims() const { return dims_; }
  int ndim() const { return static_cast<int>(dims_.size()); }
  int world_size() const { return world_size_; }
  /// The size of dimension `name`; UsageError naming the mesh's dimensions for another name.
  int size(const std::string& name) const;
  /// Whether the mesh has a dimension of that name.
  bool has(const std::string& name) const;

  /// `rank`'s place on each dimension, in dims() order.
  std::vector<int> coordinates(int rank) const;
  /// `rank`'s place on dimension `name`.
  int coordinate(int rank, const std::string& name) const;
  /// The rank at these coordinates (one per dimension, each within its size).
  int rank_at(const std::vector<int>& coordinates) const;

  /// The ranks that share every coordinate of `rank` but `name`'s, ordered by that coordinate:
  /// `rank`'s group along `name` (it holds `rank` at position coordinate(rank, name)).
  std::vector<int> group(int rank, const std::string& name) const;
  /// Every group along `name`, ordered by their first rank; each rank is in exactly one.
  std::vector<std::vector<int>> groups(const std::string& name) const;

  /// "dp=2 x pp=2".
  std::string describe() const;

 private:
  int index_of(const std::string& name) const;
  void check_rank(int rank) const;

  std::vector<MeshDim> dims_;
  std::vector<int> strides_;  // rank = sum of coordinate · stride
  int world_size_ = 1;
};

}  // namespace scaletrain
