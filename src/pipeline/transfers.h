#pragma once
// The point-to-point messages of DistPipeline's steps (internal; dist_pipeline.cpp alone
// includes it): their tags, and the transfers of one step between neighbouring stages.

#include <ATen/ATen.h>

#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "dist/p2p.h"
#include "scaletrain/dist_pipeline.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace pipeline_messages {

// Tags of the point-to-point messages that cross one boundary between stages for one
// micro-batch: the activation's shape, the activation, the gradient. `id` numbers the pair
// (micro-batch i, boundary slot): i·v + slot, where slot is the chunk of the boundary's earlier
// side (0 without interleaving, so the id is i). Messages between two ranks on one tag arrive in
// order.
inline int shape_tag(int id) { return 3 * id; }
inline int activation_tag(int id) { return 3 * id + 1; }
inline int gradient_tag(int id) { return 3 * id + 2; }

constexpr int kMaxDims = 8;
constexpr int kCountTag = 1 << 19;  // the micro-batch count, relayed from the first stage

}  // namespace pipeline_messages

// Note [Shapes once]: a receiver must know an activation's dtype and sizes before it can post
// the receive, so the first step sends them, a small message before each activation. A step
// whose batch has the dtype, sizes and micro-batch count of the last step completed here (every
// step of an epoch but a short last one) sends none: each rank keeps the shapes it sent and
// received per message id. The ranks decide together: the first stage relays the count and its
// batch's shape, each stage ANDs in whether it can reuse (it completed the last step, with that
// shape), and the last stage sends the verdict back down the chain — a rank that failed alone
// in the last step makes every rank send and expect shapes again. On Gloo such a step also
// posts its receives ahead, in the order its tasks read them; not on NCCL, whose point-to-point
// operations run in issue order on one stream, so a receive posted early would wait before a
// send it depends on. A stage whose output shape differs from the one it sent for the same
// batch shape (shapes that vary with more than the batch) fails on the sending rank.

// The point-to-point messages of one step between neighbouring stages.
class DistPipeline::Transfers {
 public:
  using Shapes = DistPipeline::Shapes;
  using Expected = DistPipeline::Expected;
  Transfers(PointToPoint& p2p, at::Device device) : p2p_(p2p), dist_(p2p.dist()), dev_(device) {}
  // After a failure mid-step, receives posted ahead are still pending: withdrawn here.
  ~Transfers() {
    for (auto& p : posted_) p.work.abort();
  }
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;

  void send(const at::Tensor& t, int to, int tag) {
    // Sends that completed let go of their tensors (1F1B's memory holds across ranks too).
    size_t done = 0;
    while (done < sends_.size() && sends_[done].done()) {
      sends_[done].wait();  // at once; throws its error, if any
      ++done;
    }
    sends_.erase(sends_.begin(), sends_.begin() + static_cast<std::ptrdiff_t>(done));
    in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(done));
    in_flight_.push_back(t.contiguous());
    sends_.push_back(p2p_.isend(in_flight_.back(), to, tag, "a pipeline send"));
  }
  void recv(at::Tensor t, int from, int tag, const std::string& what) {
    p2p_.recv(t, from, tag, what + " from rank " + std::to_string(from));
  }
  // An activation: its dtype and sizes first (NCCL moves device tensors only: the shape travels
  // on the stage's device there), then the data. `known`: the shape this id had at the last
  // step of the same batch shape (Note [Shapes once]); it is then not sent again, and an output
  // of another shape is an error.
  void send_activation(const at::Tensor& out, int to, int id, Shapes* known, bool reuse) {
    const at::Tensor a = out.detach();
    if (a.dim() > pipeline_messages::kMaxDims)
      throw Error("pipeline activations have at most 8 dimensions");
    std::vector<int64_t> mine = {static_cast<int64_t>(a.scalar_type())};
    mine.insert(mine.end(), a.sizes().begin(), a.sizes().end());
    auto cached = known ? known->find(id) : Shapes::iterator();
    if (reuse && known && cached != known->end()) {
      if (cached->second != mine) {
        throw Error("rank " + std::to_string(dist_.rank()) + ": this stage's output for message " +
                    std::to_string(id) + " has sizes " + c10::str(a.sizes()) +
                    ", another shape than at the last step of the same batch shape; a stage "
                    "whose output shape varies with more than its input's is not supported");
      }
    } else {
      auto shape = at::zeros({pipeline_messages::kMaxDims + 2}, at::kLong);
      shape[0] = a.dim();
      shape[1] = static_cast<int64_t>(a.scalar_type());
      for (int64_t d = 0; d < a.dim(); ++d) shape[d + 2] = a.size(d);
      send(dist_.backend_name == "nccl" ? shape.to(dev_) : shape, to,
           pipeline_messages::shape_tag(id));
      ++shapes_sent;
      if (known) (*known)[id] = mine;
    }
    send(a, to, pipeline_messages::activation_tag(id));
  }
  at::Tensor recv_activation(int from, int id, const std::string& which, Shapes* known,
                             bool reuse) {
    if (auto x = posted(pipeline_messages::activation_tag(id), "activation of " + which)) return *x;
    std::vector<int64_t> shape;
    auto cached = known ? known->find(id) : Shapes::iterator();
    if (reuse && known && cached != known->end()) {
      shape = cached->second;
    } else {
      const bool nccl = dist_.backend_name == "nccl";
      auto header = at::empty({pipeline_messages::kMaxDims + 2},
                              at::TensorOptions(at::kLong).device(nccl ? dev_ : at::kCPU));
      recv(header, from, pipeline_messages::shape_tag(id), "shape of " + which);
      header = header.cpu();
      const int64_t dims = header[0].item<int64_t>();
      shape.push_back(header[1].item<int64_t>());
      shape.insert(shape.end(), header.data_ptr<int64_t>() + 2,
                   header.data_ptr<int64_t>() + 2 + dims);
      if (known) (*known)[id] = shape;
    }
    const auto dtype = static_cast<at::ScalarType>(shape[0]);
    auto x = at::empty(std::vector<int64_t>(shape.begin() + 1, shape.end()),
                       at::TensorOptions().dtype(dtype).device(dev_));
    recv(x, from, pipeline_messages::activation_tag(id), "activation of " + which);
    return x;
  }
  // Receives posted ahead (Note [Shapes once]): with every shape known, this step's receives
  // are posted in the order the rank's tasks consume them, a few ahead, so a message that
  // arrives while the rank computes is already in place when its task starts.
  void expect(std::vector<Expected> list) {
    expected_ = std::move(list);
    top_up();
  }
  // The receive of `tag`, when it was posted ahead: waits for it.
  std::optional<at::Tensor> posted(int tag, const std::string& what) {
    if (posted_.empty()) return std::nullopt;
    Posted p = std::move(posted_.front());
    if (p.tag != tag) {
      throw Error("rank " + std::to_string(dist_.rank()) +
                  ": internal: the pipeline expected "
                  "message tag " +
                  std::to_string(p.tag) + " next, its task reads " + std::to_string(tag));
    }
    posted_.pop_front();
    p.work.wait(what + " from rank " + std::to_string(p.from));
    top_up();
    return p.buffer;
  }

  int64_t shapes_sent = 0;  // shape messages of this step

  // Every receive posted ahead was read by a task: the list matched the tasks.
  void check_all_received() const {
    if (!posted_.empty() || next_expected_ != expected_.size()) {
      throw Error("rank " + std::to_string(dist_.rank()) +
                  ": internal: the pipeline posted receives its tasks did not read");
    }
  }

  void wait() {
    for (auto& w : sends_) w.wait();
    sends_.clear();
    in_flight_.clear();
  }

 private:
  PointToPoint& p2p_;
  const Dist& dist_;
  at::Device dev_;
  void top_up() {
    constexpr size_t kAhead = 2;
    while (posted_.size() < kAhead && next_expected_ < expected_.size()) {
      const Expected& e = expected_[next_expected_++];
      Posted p;
      p.from = e.from;
      p.tag = e.tag;
      p.buffer = at::empty(
          std::vector<int64_t>(e.shape.begin() + 1, e.shape.end()),
          at::TensorOptions().dtype(static_cast<at::ScalarType>(e.shape[0])).device(dev_));
      p.work = p2p_.irecv(p.buffer, e.from, e.tag, "");
      posted_.push_back(std::move(p));
    }
  }
  struct Posted {
    int from = 0, tag = 0;
    at::Tensor buffer;
    Pending work;
  };

  std::vector<Pending> sends_;
  std::vector<at::Tensor> in_flight_;  // tensors of pending sends
  std::vector<Expected> expected_;
  size_t next_expected_ = 0;
  std::deque<Posted> posted_;
};

}  // namespace scaletrain
