// Note [Point-to-point paths]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pair of ranks that can map one segment (same kernel, /dev/shm and PID namespace) moves CPU
// tensors through a shared-memory link (Note [Shared-memory links] in src/transport/link.cpp);
// other pairs, device tensors and NCCL groups use the backend. Both ends must choose the same
// path, so each pair decides once, through the store: the lower rank makes the segment and posts
// its name (or "" when it cannot), the higher maps it and posts whether it could, and the lower
// reads that answer. Makers post before anyone reads, so ranks that each make one link and map
// another (a chain, a ring) never wait on each other in a cycle. The keys count the pair's
// links in the store itself, so two pipelines of the same pair, made one after the other, pair
// up in order.
//
// The link's operations become c10d works, so a Pending waits for either path the same way,
// with the same errors.

#include "dist/p2p.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>

#include "scaletrain/error.h"
#include "transport/link.h"

namespace scaletrain {
namespace {

// A send or receive of a link, as a c10d work.
class LinkWork : public c10d::Work {
 public:
  LinkWork(std::shared_ptr<LinkSet> links, int peer, uint64_t ticket, bool send, at::Tensor t,
           std::string what)
      : links_(std::move(links)),
        peer_(peer),
        ticket_(ticket),
        send_(send),
        tensor_(std::move(t)),
        what_(what.empty() ? "a point-to-point transfer" : std::move(what)) {}
  // Does not wait: a peer that left or died, or a broken link, completes it with that error,
  // which wait() throws.
  bool isCompleted() override {
    if (finished_ || !error_.empty()) return true;
    try {
      finished_ = send_ ? links_->sent(peer_, ticket_) : links_->received(peer_, ticket_);
      if (!finished_) error_ = links_->failure(peer_, what_);
    } catch (const std::exception& e) {
      error_ = e.what();
    }
    return finished_ || !error_.empty();
  }
  bool wait(std::chrono::milliseconds) override {
    if (finished_) return true;
    if (!error_.empty()) throw Error(error_);
    if (send_) {
      links_->wait_sent(peer_, ticket_, what_);
    } else {
      links_->wait_received(peer_, ticket_, what_);
    }
    finished_ = true;
    return true;
  }
  void abort() override {
    if (!send_ && !finished_) links_->withdraw(peer_, ticket_);
    finished_ = true;
  }

 private:
  std::shared_ptr<LinkSet> links_;
  int peer_;
  uint64_t ticket_;
  bool send_, finished_ = false;
  at::Tensor tensor_;  // a receive's buffer, kept alive while in flight (a send's: by the link)
  std::string what_, error_;
};

// Under the attempt's prefix: an agent's store outlives a restart, and a handshake the last
// attempt left half done must not pair with this one's.
std::string pair_key(const Dist& d, int a, int b) {
  return "scaletrain/p2p/" + std::to_string(d.world.restart_count) + "/" +
         std::to_string(std::min(a, b)) + "-" + std::to_string(std::max(a, b));
}

SharedLink::Options link_options(const Dist& dist, int peer, const PointToPointOptions& o) {
  SharedLink::Options lo;
  lo.rank = dist.rank();
  lo.peer = peer;
  lo.ring_bytes = o.ring_bytes;
  if (dist.timeout.count() > 0) lo.timeout = dist.timeout;
  return lo;
}

}  // namespace

PointToPoint::PointToPoint(const Dist& dist, const std::vector<int>& peers, at::Device device,
                           const PointToPointOptions& options)
    : dist_(dist), links_(std::make_shared<LinkSet>()) {
  require_joined(dist_, "PointToPoint");
  // Every rank of a Gloo group takes part, each saying whether its tensors live on the CPU, so
  // both ends of a pair always agree on its path.
  if (!options.shared_memory || dist_.backend_name != "gloo") return;
  const bool cpu = device.is_cpu();
  std::vector<int> mine;
  for (int p : peers) {
    if (p >= 0 && p != dist_.rank() && std::find(mine.begin(), mine.end(), p) == mine.end()) {
      mine.push_back(p);
    }
  }
  // Makers first (never wait), then the mappers, then the makers read the answers.
  struct Made {
    int peer;
    std::string key;
    std::unique_ptr<SharedLink> link;  // null: none could be made
  };
  std::vector<Made> made;
  for (int p : mine) {
    if (p < dist_.rank()) continue;
    const std::string pair = pair_key(dist_, p, dist_.rank());
    const std::string key = pair + "/" + std::to_string(dist_.store_add(pair + "/made", 1));
    std::unique_ptr<SharedLink> link;
    try {
      if (cpu) link = SharedLink::create(link_options(dist_, p, options));
    } catch (const Error&) {  // no room in /dev/shm: the backend carries this pair
    }
    dist_.store_set(key + "/name", link ? link->name() : "");
    made.push_back({p, key, std::move(link)});
  }
  for (int p : mine) {
    if (p > dist_.rank()) continue;
    const std::string pair = pair_key(dist_, p, dist_.rank());
    const std::string key = pair + "/" + std::to_string(dist_.store_add(pair + "/mapped", 1));
    const std::string name = dist_.store_get(key + "/name");
    std::unique_ptr<SharedLink> link;
    try {
      if (cpu && !name.empty()) link = SharedLink::attach(name, link_options(dist_, p, options));
    } catch (const Error&) {  // another machine: the backend carries this pair
    }
    dist_.store_set(key + "/mapped", link ? "1" : "0");
    if (link) links_->add(p, std::move(link));
  }
  for (auto& m : made) {
    const bool mapped = dist_.store_get(m.key + "/mapped") == "1";
    if (!m.link) continue;
    m.link->unlink();
    if (mapped) links_->add(m.peer, std::move(m.link));
  }
}

PointToPoint::~PointToPoint() = default;

bool PointToPoint::shared(int peer) const { return links_->has(peer); }

bool PointToPoint::uses_link(const at::Tensor& t, int peer) const {
  if (!links_->has(peer)) return false;
  if (!t.device().is_cpu() || !t.is_contiguous()) {
    throw UsageError("rank " + std::to_string(dist_.rank()) + ": a transfer to or from rank " +
                     std::to_string(peer) +
                     " goes through shared memory, which carries contiguous CPU tensors; got " +
                     (t.is_contiguous() ? "one on " + t.device().str() : "a strided one"));
  }
  return true;
}

Pending PointToPoint::isend(const at::Tensor& tensor, int dst, int tag, const std::string& what) {
  if (!uses_link(tensor, dst)) return dist_.isend(tensor, dst, tag, what);
  // The link holds the tensor until it is written, even if this send is dropped unwaited.
  const uint64_t ticket =
      links_->send(dst, tag, tensor.data_ptr(), tensor.nbytes(),
                   std::shared_ptr<const void>(tensor.data_ptr(), [t = tensor](const void*) {}));
  return Pending(c10::make_intrusive<LinkWork>(links_, dst, ticket, true, at::Tensor(), what), what,
                 dist_);
}

Pending PointToPoint::irecv(at::Tensor& tensor, int src, int tag, const std::string& what) {
  if (!uses_link(tensor, src)) return dist_.irecv(tensor, src, tag, what);
  const uint64_t ticket = links_->post(src, tag, tensor.data_ptr(), tensor.nbytes());
  return Pending(c10::make_intrusive<LinkWork>(links_, src, ticket, false, tensor, what), what,
                 dist_);
}

void PointToPoint::send(const at::Tensor& tensor, int dst, int tag, const std::string& what) {
  isend(tensor, dst, tag, what).wait();
}

void PointToPoint::recv(at::Tensor& tensor, int src, int tag, const std::string& what) {
  irecv(tensor, src, tag, what).wait();
}

}  // namespace scaletrain
