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
#include <memory>
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
  /// Every process beats in the store at this interval, so that a collective that times out
  /// names the ranks that stopped answering (SIGSTOP, frozen, cut off) by rank, host and pid
  /// (Note [Heartbeats] in src/dist/heartbeat.h). 0: no heartbeat.
  std::chrono::milliseconds heartbeat_interval = std::chrono::seconds(1);
  /// The job's secret (secret.h): rank 0 serves the store only to processes that prove it.
  /// Empty: SCALETRAIN_WORLD_SECRET (`scaletrain run` gives it), else the user's
  /// (SCALETRAIN_SECRET, SCALETRAIN_SECRET_FILE); with none, and under torchrun (whose agent
  /// serves the store), PyTorch's TCPStore, which trusts whoever reaches MASTER_PORT.
  std::string secret;
};

class Heartbeat;  // src/dist/heartbeat.h

/// The backend "auto" stands for: "nccl" when there are GPUs and at least one per local process
/// (NCCL refuses two ranks on one GPU), else "gloo". Other names are returned as they are.
std::string resolve_backend(const std::string& backend, int gpus, int local_world_size);

/// The reduction of a collective: ReduceOp::SUM (the default), MIN, MAX, PRODUCT; AVG with NCCL.
using ReduceOp = c10d::ReduceOp;

struct Dist;
class PointToPoint;

/// A collective or point-to-point transfer in flight: the `_async` methods and isend/irecv of
/// Dist return one. The tensors it reads or writes must live, untouched, until it completes. A
/// default-constructed Pending is complete already. Not for concurrent use by threads.
class Pending {
 public:
  Pending() = default;

  /// Waits for it, once (later calls return at once). A failure or a wait past the group's
  /// timeout is an Error naming what it is, this rank and the timeout (wait_for below).
  void wait();
  /// The same, naming it `what` in errors instead (a receive posted before its reader was known).
  void wait(const std::string& what);
  /// Whether it has completed (a failure too: wait() throws it). Does not block.
  bool done() const;
  /// Whether it holds an operation not waited for yet.
  explicit operator bool() const { return static_cast<bool>(work_); }
  /// Withdraws it unwaited (a receive nobody will read after a failure); swallows any error.
  void abort() noexcept;

 private:
  friend struct Dist;
  friend class PointToPoint;  // its shared-memory transfers (src/dist/p2p.h)
  Pending(c10::intrusive_ptr<c10d::Work> work, std::string what, const Dist& dist);
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds timeout_{};
  std::shared_ptr<const Heartbeat> heartbeat_;
};

/// A joined process group. Holds the store and the backend alive; copyable (shared handles).
struct Dist {
  World world;
  std::string backend_name;  // "gloo" or "nccl"
  // The c10d handles, for programs that need c10d itself. The library reaches them only in
  // src/dist; everything else goes through the methods below (Structure.NoC10dOutsideDist).
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout{};         // the collective timeout the backend was made with
  std::shared_ptr<const Heartbeat> heartbeat;  // this process's (InitOptions::heartbeat_interval)

  int rank() const { return world.rank; }
  int size() const { return world.world_size; }
  /// Whether it holds a process group (init_process_group's); a default-constructed one does not.
  bool joined() const { return static_cast<bool>(backend); }

  // Collectives over the group, with PyTorch's names. Each waits for its result: a failure or a
  // wait past `timeout` is an Error naming the operation (`what`, or a description of the call
  // when empty), this rank and the timeout (wait_for below). The `_async` forms return a Pending
  // instead, whose wait() gives those errors. Every rank calls them in the same order, with
  // tensors of the same shape and dtype. Gloo carries CPU and CUDA tensors, NCCL CUDA tensors.
  // Not for concurrent use by threads.

  /// In place: `tensor` reduced over the ranks (sum by default).
  void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::SUM,
                  const std::string& what = "") const;
  Pending all_reduce_async(at::Tensor& tensor, ReduceOp op = ReduceOp::SUM,
                           const std::string& what = "") const;
  /// In place: rank `src`'s `tensor` on every rank.
  void broadcast(at::Tensor& tensor, int src = 0, const std::string& what = "") const;
  /// Every rank's `tensor`, by rank.
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor, const std::string& what = "") const;
  /// Every rank's `tensor` (same shape everywhere) concatenated along dimension 0, by rank:
  /// PyTorch's all_gather_into_tensor.
  at::Tensor all_gather_into_tensor(const at::Tensor& tensor, const std::string& what = "") const;
  /// The same into `out`, which holds size() times `input` along dimension 0 (contiguous).
  Pending all_gather_into_tensor_async(at::Tensor& out, const at::Tensor& input,
                                       const std::string& what = "") const;
  /// `input`'s dimension 0 holds size() equal slices: returns this rank's slice of their
  /// reduction over the ranks (PyTorch's reduce_scatter_tensor). Throws UsageError when dimension
  /// 0 does not split evenly.
  at::Tensor reduce_scatter_tensor(const at::Tensor& input, ReduceOp op = ReduceOp::SUM,
                                   const std::string& what = "") const;
  /// The same into `out` (one slice's shape; `input` contiguous).
  Pending reduce_scatter_tensor_async(at::Tensor& out, const at::Tensor& input,
                                      ReduceOp op = ReduceOp::SUM,
                                      const std::string& what = "") const;
  /// PyTorch's all_to_all_single: `input`'s dimension 0 holds, in rank order, the rows this rank
  /// sends to each rank (input_splits[r] rows to rank r; empty: size() equal parts), and the
  /// result holds the rows each rank sent this one, in rank order (output_splits[r] from rank r;
  /// empty: equal parts), the other dimensions as `input`'s. Each pair of ranks must agree on what
  /// goes between them (the row counts are usually exchanged first, by an all-to-all of one count
  /// per rank). Throws UsageError when the splits have another length than size(), are
  /// negative, or do not add up to `input`'s rows, or when an empty split does not divide them.
  at::Tensor all_to_all_single(const at::Tensor& input,
                               const std::vector<int64_t>& output_splits = {},
                               const std::vector<int64_t>& input_splits = {},
                               const std::string& what = "") const;
  /// Returns when every rank has called it.
  void barrier(const std::string& what = "") const;

  // Point-to-point, matched by (peer, tag): rank `dst`'s recv from this rank with the same tag
  // receives what send sends, in order. Same errors as the collectives.

  /// Sends `tensor` (contiguous) to rank `dst`.
  void send(const at::Tensor& tensor, int dst, int tag = 0, const std::string& what = "") const;
  /// Receives into `tensor` (its shape and dtype those sent) from rank `src`.
  void recv(at::Tensor& tensor, int src, int tag = 0, const std::string& what = "") const;
  Pending isend(const at::Tensor& tensor, int dst, int tag = 0, const std::string& what = "") const;
  Pending irecv(at::Tensor& tensor, int src, int tag = 0, const std::string& what = "") const;

  // The job's key-value store (rendezvous's): small agreements outside the collectives.

  /// Adds `by` to the counter `key` (0 when new) and returns its new value.
  int64_t store_add(const std::string& key, int64_t by) const;
  void store_set(const std::string& key, const std::string& value) const;
  /// The value of `key`, waiting for it up to the store's timeout.
  std::string store_get(const std::string& key) const;
  /// Whether `key` has a value (does not wait).
  bool store_check(const std::string& key) const;
};

/// Throws UsageError naming `who` when `dist` holds no process group (a default-constructed
/// Dist): every wrapper checks its Dist with it before the first collective.
void require_joined(const Dist& dist, const std::string& who);

/// Checks `options` before any process of the job starts, as a launcher of its own ranks needs
/// (init_process_group() refuses the same later, in every rank): a backend other than "gloo",
/// "nccl" or "auto", "nccl" where no GPU is visible or the library has no CUDA, a timeout that is
/// not positive, a negative heartbeat interval. Throws UsageError naming the value and the fix.
void validate(const InitOptions& options);

/// Joins the job's process group. Throws Error (run id mismatch, missing ranks after the
/// rendezvous timeout, duplicate rank, unknown backend, NCCL without CUDA) with the rank and
/// the fix in the message.
Dist init_process_group(const InitOptions& options = {});

/// Waits for a collective. A failure or a timeout becomes an Error naming the operation
/// (`op`, e.g. "all-reduce of bucket 3"), this rank, the timeout and what to look for; after a
/// timeout, the ranks of the world that stopped answering too (Note [Heartbeats]).
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op, const Dist& dist);

/// The same group over a backend of its own (new connections; its keys under `prefix` in the
/// store): its collectives run beside `dist`'s and never queue behind them. Collective.
Dist clone_group(const Dist& dist, const std::string& prefix);

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
