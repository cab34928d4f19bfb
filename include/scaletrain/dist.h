#pragma once
// Process-group bootstrap: rendezvous through a c10d TCPStore on the master, then a c10d
// backend — Gloo for CPU tensors, NCCL for CUDA tensors.
//
//   auto dist = scaletrain::init_process_group();          // reads the world from the env
//   auto t = at::ones({4});
//   dist.all_reduce(t);                                    // t = world_size everywhere
//
// Rendezvous (Note [Rendezvous]): rank 0 hosts the store. Every process first checks that the
// store serves its own run id (a process of another job that reaches the same port is refused
// with an error), then announces its rank. Rank 0 waits for all ranks up to
// rendezvous_timeout and names the ranks that never arrived; the others wait for rank 0's go.
// Two processes claiming one rank are refused too.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/mesh.h"
#include "scaletrain/world.h"

namespace scaletrain {

struct InitOptions {
  /// "gloo", "nccl", or "auto": NCCL when every local process can have a GPU of its own, else
  /// Gloo (see resolve_backend()). Gloo also carries CUDA tensors (all-reduce, broadcast).
  std::string backend = "auto";
  /// A collective that waits longer than this fails with an error naming it and the rank.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  /// How long rendezvous waits for every rank. SCALETRAIN_RDZV_TIMEOUT (seconds), which
  /// `scaletrain run --rdzv-timeout` sets, overrides it.
  std::chrono::milliseconds rendezvous_timeout = std::chrono::minutes(5);
  /// The world; by default discover_world() reads it from the environment.
  std::optional<World> world;
};

/// The backend "auto" stands for: "nccl" when there are GPUs and at least one per local process
/// (NCCL refuses two ranks on one GPU), else "gloo". Other names are returned as they are.
std::string resolve_backend(const std::string& backend, int gpus, int local_world_size);

/// A joined process group. Holds the store and the backend alive; copyable (shared handles).
struct Dist {
  World world;
  std::string backend_name;  // "gloo" or "nccl"
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout{};  // the collective timeout the backend was made with

  int rank() const { return world.rank; }
  int size() const { return world.world_size; }

  // Collectives over the group, with PyTorch's names. Each waits for its result: a failure or a
  // wait past `timeout` is an Error naming the operation, this rank and the timeout (wait_for
  // below). Every rank calls them in the same order, with tensors of the same shape and dtype.
  // Gloo carries CPU and CUDA tensors, NCCL CUDA tensors. Not for concurrent use by threads.

  /// In place: `tensor` reduced over the ranks (sum by default).
  void all_reduce(at::Tensor& tensor, c10d::ReduceOp op = c10d::ReduceOp::SUM) const;
  /// In place: rank `src`'s `tensor` on every rank.
  void broadcast(at::Tensor& tensor, int src = 0) const;
  /// Every rank's `tensor`, by rank.
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) const;
  /// Every rank's `tensor` (same shape everywhere) concatenated along dimension 0, by rank:
  /// PyTorch's all_gather_into_tensor.
  at::Tensor all_gather_into_tensor(const at::Tensor& tensor) const;
  /// `input`'s dimension 0 holds size() equal slices: returns this rank's slice of their
  /// reduction over the ranks (PyTorch's reduce_scatter_tensor). Throws UsageError when dimension
  /// 0 does not split evenly.
  at::Tensor reduce_scatter_tensor(const at::Tensor& input,
                                   c10d::ReduceOp op = c10d::ReduceOp::SUM) const;
  /// Returns when every rank has called it.
  void barrier() const;
};

/// Throws UsageError naming `who` when `dist` holds no process group (a default-constructed
/// Dist): every wrapper checks its Dist with it before the first collective.
void require_joined(const Dist& dist, const std::string& who);

/// Joins the job's process group. Throws Error (run id mismatch, missing ranks after the
/// rendezvous timeout, duplicate rank, unknown backend, NCCL without CUDA) with the rank and
/// the fix in the message.
Dist init_process_group(const InitOptions& options = {});

/// Waits for a collective. A failure or a timeout becomes an Error naming the operation
/// (`op`, e.g. "all-reduce of bucket 3"), this rank, the timeout and what to look for.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op, const Dist& dist);

/// A process group of some of the ranks (torch.distributed.new_group): every rank of the world
/// calls it with the same `ranks` and `name`; members get a Dist in which they are ranked by
/// their position in `ranks`, others nullopt. Same backend kind as `dist`. Throws UsageError for
/// a rank out of range or listed twice.
std::optional<Dist> new_group(const Dist& dist, const std::vector<int>& ranks,
                              const std::string& name);

/// Collective over the world: this rank's process group along each dimension of `mesh`
/// (DeviceMesh::group: the ranks that differ from it on that dimension alone), by dimension name,
/// each ranked by its mesh coordinate there. Every rank calls it with the same mesh and `name`
/// (which keeps two meshes' groups apart). `only`: the dimensions to make groups for (each
/// group is a backend with its own connections; empty: every dimension). Throws UsageError when
/// the mesh is not of this world or names no such dimension.
std::map<std::string, Dist> mesh_groups(const Dist& world, const DeviceMesh& mesh,
                                        const std::string& name = "mesh",
                                        const std::vector<std::string>& only = {});

/// Makes one more backend over the same store (e.g. Gloo beside NCCL), with its own key prefix.
c10::intrusive_ptr<c10d::Backend> new_backend(const Dist& dist, const std::string& backend,
                                              const std::string& prefix,
                                              std::chrono::milliseconds timeout);

}  // namespace scaletrain
