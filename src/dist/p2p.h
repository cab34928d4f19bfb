#pragma once
// Point-to-point transfers between a rank and its peers (internal). Note [Point-to-point paths]
// in p2p.cpp: CPU tensors between ranks on one machine go through shared-memory links
// (src/transport/link.h); everything else through the process group's backend. Callers never
// choose.

#include <memory>
#include <string>
#include <vector>

#include "scaletrain/dist.h"

namespace scaletrain {

class LinkSet;

struct PointToPointOptions {
  /// CPU tensors to same-machine peers through a shared-memory link when both ends can map it
  /// (a Gloo group); else, and for device tensors, the backend.
  bool shared_memory = true;
  int64_t ring_bytes = 8 << 20;  // per link and direction
};

class PointToPoint {
 public:
  /// Collective between each pair of ranks that name each other in `peers` (a rank's
  /// neighbours; other ranks of `dist` are not involved). `device`: where the tensors live.
  PointToPoint(const Dist& dist, const std::vector<int>& peers, at::Device device,
               const PointToPointOptions& options = {});
  ~PointToPoint();
  PointToPoint(const PointToPoint&) = delete;
  PointToPoint& operator=(const PointToPoint&) = delete;

  /// Dist's isend/irecv/send/recv (the same matching by peer and tag, the same errors), over the
  /// path of the peer. `tensor` contiguous.
  Pending isend(const at::Tensor& tensor, int dst, int tag, const std::string& what);
  Pending irecv(at::Tensor& tensor, int src, int tag, const std::string& what);
  void send(const at::Tensor& tensor, int dst, int tag, const std::string& what);
  void recv(at::Tensor& tensor, int src, int tag, const std::string& what);

  /// Whether messages to `peer` go through shared memory.
  bool shared(int peer) const;
  const Dist& dist() const { return dist_; }

 private:
  bool uses_link(const at::Tensor& t, int peer) const;
  Dist dist_;
  std::shared_ptr<LinkSet> links_;
};

}  // namespace scaletrain
