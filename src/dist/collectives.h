#pragma once
// The collectives DDP runs on gradient buckets and flags (internal). Note [Collectives] in
// collectives.cpp: one interface, and behind it either the process group's c10d backend alone;
// or, for ranks that share a machine, one shared-memory segment for float32 CPU tensors with the
// backend for everything else; or, for ranks on several machines, a segment per machine and the
// backend between one leader per machine (Note [Hierarchical reduce]). The reducer never
// chooses a path itself.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/dist.h"

namespace scaletrain {

class Collectives {
 public:
  virtual ~Collectives() = default;

  /// Starts the sum of `t` over the group, in place. Returns it in flight (Pending in dist.h),
  /// complete already on the shared-memory paths. Every rank calls it with tensors of the same
  /// shape, dtype and device, in the same order. `what` names it in errors.
  virtual Pending all_reduce_sum(at::Tensor& t, const std::string& what) = 0;

  /// Every rank's `mine`, by rank (blocking).
  virtual std::vector<int32_t> all_gather_flags(int32_t mine, const std::string& what) = 0;

  /// `out` = every rank's `mine` in rank order (PyTorch's all_gather_into_tensor: `out` holds
  /// the group's size times mine's elements, of mine's dtype, on its device). Blocking. Every
  /// rank calls it with the same sizes, in the same order.
  virtual void all_gather_into(at::Tensor& out, const at::Tensor& mine,
                               const std::string& what) = 0;

  /// Whether float32 CPU tensors go through one shared-memory segment of the whole group.
  virtual bool shared_memory() const = 0;

  /// The path float32 CPU sums take, for reports: "gloo", "nccl", "shared memory", or
  /// "hierarchical (M machines)".
  virtual std::string path() const = 0;
};

struct CollectivesOptions {
  /// Same-machine ranks sum float32 CPU tensors through a /dev/shm segment when every rank of the
  /// group can map it (Note [Shared-memory reduce] in src/transport/shm.cpp); else the backend.
  bool shared_memory = true;
  int64_t chunk_floats = 1 << 20;  // the segment's floats per rank (a tensor larger goes through
                                   // it in rounds)
  /// With shared_memory, when the group spans machines: sum within each machine through its
  /// segment, across machines between one leader per machine over the backend, and hand the
  /// result back through the segment (Note [Hierarchical reduce]). Needs every machine's ranks
  /// to map their segment; else every rank uses the backend.
  bool hierarchical = false;
};

/// Collective over `dist` (every rank calls it, in the same order): the collectives for it.
/// `key` names the shared segment in the store; one key per call.
std::unique_ptr<Collectives> make_collectives(const Dist& dist, const CollectivesOptions& options,
                                              const std::string& key);

}  // namespace scaletrain
