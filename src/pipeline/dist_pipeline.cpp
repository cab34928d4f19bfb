#include "scaletrain/dist_pipeline.h"

#include "pipeline/split_backward.h"

#include <ATen/ATen.h>

#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/schedule.h"

#include <deque>
#include <optional>

namespace scaletrain {

namespace {

// Tags of the point-to-point messages that cross one boundary between stages for one
// micro-batch: the activation's shape, the activation, the gradient. `id` numbers the pair
// (micro-batch i, boundary slot): i·v + slot, where slot is the chunk of the boundary's earlier
// side (0 without interleaving, so the id is i). Messages between two ranks on one tag arrive in
// order.
int shape_tag(int id) { return 3 * id; }
int activation_tag(int id) { return 3 * id + 1; }
int gradient_tag(int id) { return 3 * id + 2; }

constexpr int kMaxDims = 8;
constexpr int kCountTag = 1 << 19;  // the micro-batch count, relayed from the first stage

// Where the gradient of `output` is received: contiguous (the backends move contiguous tensors
// only; the sender makes its gradient contiguous), whatever the output's memory format
// (channels-last convolutions).
at::Tensor gradient_buffer(const at::Tensor& output) {
  return at::empty(output.sizes(), output.options());
}

}  // namespace

torch::nn::Sequential slice(const torch::nn::Sequential& model, size_t begin, size_t end) {
  if (begin > end || end > model->size()) {
    throw UsageError("slice [" + std::to_string(begin) + ", " + std::to_string(end) +
                     ") of a model of " + std::to_string(model->size()) + " layers");
  }
  torch::nn::Sequential out;
  const auto names = model->named_children().keys();
  size_t i = 0;
  for (const torch::nn::AnyModule& layer : *model) {
    if (i >= begin && i < end) out->push_back(names[i], layer);
    ++i;
  }
  return out;
}

DistPipeline::DistPipeline(torch::nn::Sequential stage, DistPipelineOptions options,
                           const Dist& dist)
    : DistPipeline(std::vector<torch::nn::Sequential>{std::move(stage)}, std::move(options), dist) {
}

DistPipeline::DistPipeline(std::vector<torch::nn::Sequential> chunks, DistPipelineOptions options,
                           const Dist& dist)
    : chunks_(std::move(chunks)), options_(std::move(options)), dist_(dist) {
  if (chunks_.empty()) throw UsageError("a pipeline stage needs at least one chunk of layers");
  require_joined(dist_, "DistPipeline");
  stage_module_ = chunks_[0];
  const auto& ranks = options_.stage_ranks;
  auto me = std::find(ranks.begin(), ranks.end(), dist.rank());
  if (me == ranks.end()) {
    throw UsageError("rank " + std::to_string(dist.rank()) +
                     " is not one of the pipeline's stage_ranks; give every stage's rank");
  }
  if (options_.chunks < 1) {
    throw UsageError("chunks must be at least 1, got " + std::to_string(options_.chunks));
  }
  const bool interleaved = options_.schedule == PipelineSchedule::kInterleaved1F1B;
  if (interleaved != (chunks_.size() > 1)) {
    throw UsageError(
        interleaved
            ? "interleaved 1F1B gives each rank at least 2 stages (chunks); got 1: give "
              "the constructor this rank's chunks, or use --schedule 1f1b"
            : "rank " + std::to_string(dist.rank()) + " holds " + std::to_string(chunks_.size()) +
                  " chunks of layers: more than one stage per rank is interleaved 1F1B "
                  "(PipelineSchedule::kInterleaved1F1B)");
  }
  if (interleaved && options_.stage_ranks.size() < 2) {
    throw UsageError("interleaved 1F1B across ranks needs at least 2 ranks, got " +
                     std::to_string(options_.stage_ranks.size()));
  }
  if (interleaved && options_.ddp != nullptr) {
    throw UsageError(
        "interleaved 1F1B across ranks runs without DDP sub-groups: a grid's stages take GPipe "
        "or 1F1B");
  }
  if (options_.schedule == PipelineSchedule::kZeroBubbleH1 && options_.ddp != nullptr) {
    throw UsageError(
        "zero bubble H1 across ranks runs without DDP sub-groups: a grid's stages take GPipe or "
        "1F1B");
  }
  stage_ = static_cast<int>(me - ranks.begin());
  for (auto& c : chunks_) c->to(options_.device);
}

// Note [Pipeline across ranks]: each rank runs its stage's column of the schedule table in
// order (interleaved 1F1B: its row of interleaved_order, over its chunks; chunk c of rank r is
// the model's stage c·p + r, so the last rank's chunk c feeds the first rank's chunk c + 1). A
// forward receives its input (shape, then data) from the previous stage, unless it is the first;
// runs the stage; sends the output on, unless it is the last, which computes the loss. A backward
// receives the gradient of the stage's output from the next stage (the last starts from its loss),
// backpropagates, and sends the gradient of the stage's input back. Sends are asynchronous and
// waited for at the end; receives block. The table orders every rank's tasks consistently with the
// data they need, so the ranks cannot wait on each other in a cycle. Note [Pipeline and DDP]: DDP
// expects forward then backward, one pair at a time, while a pipeline stage interleaves the
// forwards and backwards of many micro-batches. So the stage's forwards bypass DDP, and the output
// of the micro-batch whose backward comes last is prepared for backward (prepare_for_backward) just
// before that backward: the reducer arms, the backward's hooks find the gradients accumulated by
// the earlier (no_sync) backwards in the buckets, and the all-reduce averages their sum over the
// replicas.

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
  Transfers(const Dist& dist, at::Device device) : dist_(dist), dev_(device) {}
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
    sends_.push_back(dist_.isend(in_flight_.back(), to, tag, "a pipeline send"));
  }
  void recv(at::Tensor t, int from, int tag, const std::string& what) {
    dist_.recv(t, from, tag, what + " from rank " + std::to_string(from));
  }
  // An activation: its dtype and sizes first (NCCL moves device tensors only: the shape travels
  // on the stage's device there), then the data. `known`: the shape this id had at the last
  // step of the same batch shape (Note [Shapes once]); it is then not sent again, and an output
  // of another shape is an error.
  void send_activation(const at::Tensor& out, int to, int id, Shapes* known, bool reuse) {
    const at::Tensor a = out.detach();
    if (a.dim() > kMaxDims) throw Error("pipeline activations have at most 8 dimensions");
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
      auto shape = at::zeros({kMaxDims + 2}, at::kLong);
      shape[0] = a.dim();
      shape[1] = static_cast<int64_t>(a.scalar_type());
      for (int64_t d = 0; d < a.dim(); ++d) shape[d + 2] = a.size(d);
      send(dist_.backend_name == "nccl" ? shape.to(dev_) : shape, to, shape_tag(id));
      ++shapes_sent;
      if (known) (*known)[id] = mine;
    }
    send(a, to, activation_tag(id));
  }
  at::Tensor recv_activation(int from, int id, const std::string& which, Shapes* known,
                             bool reuse) {
    if (auto x = posted(activation_tag(id), "activation of " + which)) return *x;
    std::vector<int64_t> shape;
    auto cached = known ? known->find(id) : Shapes::iterator();
    if (reuse && known && cached != known->end()) {
      shape = cached->second;
    } else {
      const bool nccl = dist_.backend_name == "nccl";
      auto header =
          at::empty({kMaxDims + 2}, at::TensorOptions(at::kLong).device(nccl ? dev_ : at::kCPU));
      recv(header, from, shape_tag(id), "shape of " + which);
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
    recv(x, from, activation_tag(id), "activation of " + which);
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
      p.work = dist_.irecv(p.buffer, e.from, e.tag);
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

int DistPipeline::neighbour(int offset) const {
  const int s = stage_ + offset;
  return s < 0 || s >= num_stages() ? -1 : options_.stage_ranks[static_cast<size_t>(s)];
}

bool DistPipeline::first_of_model(int chunk) const { return stage_ == 0 && chunk == 0; }
bool DistPipeline::last_of_model(int chunk) const {
  return stage_ == num_stages() - 1 && chunk == num_chunks() - 1;
}
// The rank that feeds this rank's chunks, and the one they feed (a ring when interleaving).
int DistPipeline::previous_rank() const {
  return stage_ > 0 ? neighbour(-1) : options_.stage_ranks.back();
}
int DistPipeline::next_rank() const {
  return stage_ + 1 < num_stages() ? neighbour(+1) : options_.stage_ranks.front();
}
// Message ids of micro-batch i at the input and at the output boundary of `chunk`.
int DistPipeline::input_id(int i, int chunk) const {
  return i * num_chunks() + (stage_ > 0 ? chunk : chunk - 1);
}
int DistPipeline::output_id(int i, int chunk) const { return i * num_chunks() + chunk; }

std::string DistPipeline::which(int i, int chunk) const {
  return "micro-batch " + std::to_string(i) +
         (num_chunks() > 1 ? " (chunk " + std::to_string(chunk) + ")" : "");
}

std::vector<at::Tensor> DistPipeline::split(const at::Tensor& t, const char* what) const {
  if (!t.defined() || t.size(0) < 1) {
    throw UsageError(std::string("rank ") + std::to_string(dist_.rank()) + " (stage " +
                     std::to_string(stage_) + ") needs the batch's " + what);
  }
  return split_microbatches(t, options_.chunks);
}

// The step's micro-batch count: `chunks`, or fewer for a batch of fewer samples. The first stage
// knows it from the input and tells the next, which tells the next...
DistPipeline::Agreed DistPipeline::agree_microbatches(const at::Tensor& input) {
  Agreed a = relay_microbatches(input);
  // Message ids i·v + slot: their three tags must stay below the count's.
  if (3 * (static_cast<int64_t>(a.count) * num_chunks()) + 2 >= kCountTag) {
    throw UsageError("rank " + std::to_string(dist_.rank()) + ": " + std::to_string(a.count) +
                     " micro-batches of " + std::to_string(num_chunks()) +
                     " chunks exceed the pipeline's message tags; use fewer chunks");
  }
  return a;
}

// The micro-batch count and the batch's dtype and sizes, relayed from the first stage, and
// whether every stage can reuse its shapes (Note [Shapes once]): each stage ANDs its own answer
// into the relay, and the last stage sends the verdict back down the chain.
DistPipeline::Agreed DistPipeline::relay_microbatches(const at::Tensor& input) {
  // count, reuse, dtype, dims, sizes...
  constexpr int64_t kLen = 4 + kMaxDims;
  const bool nccl = dist_.backend_name == "nccl";
  const auto on = at::TensorOptions(at::kLong).device(nccl ? options_.device : at::kCPU);
  at::Tensor msg = at::zeros({kLen}, at::kLong);
  const int prev = stage_ > 0 ? neighbour(-1) : -1;
  const int next = stage_ + 1 < num_stages() ? neighbour(+1) : -1;
  if (stage_ == 0) {
    const int64_t n = input.defined() ? input.size(0) : 0;
    if (input.defined() && input.dim() > kMaxDims) {
      throw UsageError("a pipeline's input has at most 8 dimensions, got " +
                       std::to_string(input.dim()));
    }
    msg[0] = std::min<int64_t>(options_.chunks, n);
    msg[2] = input.defined() ? static_cast<int64_t>(input.scalar_type()) : -1;
    msg[3] = input.defined() ? input.dim() : 0;
    for (int64_t d = 0; input.defined() && d < input.dim(); ++d) msg[4 + d] = input.size(d);
  } else {
    at::Tensor in = at::empty({kLen}, on);
    dist_.recv(in, prev, kCountTag, "micro-batch count from rank " + std::to_string(prev));
    msg = in.cpu();
  }
  const auto key = std::vector<int64_t>(msg.data_ptr<int64_t>() + 2,
                                        msg.data_ptr<int64_t>() + 4 + msg[3].item<int64_t>());
  const bool mine = shapes_valid_ && key == shaped_key_ && msg[0].item<int64_t>() == shaped_count_;
  msg[1] = (stage_ == 0 || msg[1].item<int64_t>() == 1) && mine ? 1 : 0;
  if (next >= 0) {
    dist_.send(msg.to(on), next, kCountTag, "micro-batch count");
    at::Tensor verdict = at::empty({1}, on);
    dist_.recv(verdict, next, kCountTag + 1, "shape verdict from rank " + std::to_string(next));
    msg[1] = verdict.cpu()[0];
  }
  if (prev >= 0) {
    dist_.send(msg.narrow(0, 1, 1).to(on).contiguous(), prev, kCountTag + 1, "shape verdict");
  }
  return {static_cast<int>(msg[0].item<int64_t>()), msg[1].item<int64_t>() == 1, key};
}

// Every receive of a step whose shapes are known, in the order `order`'s tasks read them.
std::vector<DistPipeline::Expected> DistPipeline::expected_receives(
    const std::vector<PipeTask>& order) const {
  std::vector<Expected> out;
  for (const auto& t : order) {
    const int i = t.microbatch, c = t.chunk;
    if (t.forward()) {
      if (first_of_model(c)) continue;
      out.push_back(
          {previous_rank(), activation_tag(input_id(i, c)), received_shapes_.at(input_id(i, c))});
    } else if (t.pass != Pass::kWeightGrad && !last_of_model(c)) {
      out.push_back({next_rank(), gradient_tag(output_id(i, c)), sent_shapes_.at(output_id(i, c))});
    }
  }
  return out;
}

// This stage's column of the schedule of `m` micro-batches, in order.
std::vector<PipeTask> DistPipeline::my_tasks(int m) const {
  if (options_.schedule == PipelineSchedule::kInterleaved1F1B) {
    return interleaved_order(num_stages(), num_chunks(), m)[static_cast<size_t>(stage_)];
  }
  const ScheduleTable table = options_.schedule == PipelineSchedule::kGPipe
                                  ? gpipe_schedule(num_stages(), m)
                              : options_.schedule == PipelineSchedule::kZeroBubbleH1
                                  ? zero_bubble_h1_schedule(num_stages(), m)
                                  : one_f_one_b_schedule(num_stages(), m);
  std::vector<PipeTask> order;
  for (const auto& row : table) {
    if (row[static_cast<size_t>(stage_)]) order.push_back(*row[static_cast<size_t>(stage_)]);
  }
  return order;
}

// One training step on this stage: the micro-batches, their tensors per (micro-batch, chunk) at
// index i·v + c, and the transfers; run() does one task of the stage's column of the schedule.
class DistPipeline::Step {
 public:
  Step(DistPipeline& pipe, const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn)
      : p_(pipe), loss_fn_(loss_fn), io_(pipe.dist_, pipe.options_.device) {
    first_ = p_.stage_ == 0;
    last_ = p_.stage_ == p_.num_stages() - 1;
    xs_ = first_ ? p_.split(input, "input") : std::vector<at::Tensor>{};
    agreed_ = p_.agree_microbatches(input);
    const auto m = static_cast<size_t>(agreed_.count);
    // Note [Shapes once]: the same batch shape as the last step's sends no shapes, and receives
    // are posted ahead (Gloo matches them by tag; NCCL's, in issue order on one stream, would
    // wait for a receive posted before the send it depends on).
    const bool post_ahead = agreed_.reuse && p_.dist_.backend_name != "nccl";
    p_.shapes_valid_ = false;
    ys_ = last_ ? p_.split(target, "target") : std::vector<at::Tensor>{};
    if (last_ && ys_.size() != m) {
      throw UsageError("rank " + std::to_string(p_.dist_.rank()) +
                       " (last stage): the batch's target has " + std::to_string(target.size(0)) +
                       " samples, the input " + std::to_string(m) +
                       " micro-batches' worth: give both stages the same batch");
    }
    total_ = last_ ? static_cast<double>(target.size(0)) : 0;
    order_ = p_.my_tasks(agreed_.count);
    for (const auto& t : order_) {
      if (!t.forward()) last_backward_ = t.microbatch;
    }
    v_ = static_cast<size_t>(p_.num_chunks());
    inputs_.resize(m * v_);
    outputs_.resize(m * v_);
    losses_.resize(m);
    // Zero bubble H1 (one chunk): the backward split into I and W (Note [Split backward]).
    split_ = p_.options_.schedule == PipelineSchedule::kZeroBubbleH1;
    if (split_) halves_.emplace(p_.stage_module_);
    graphs_.resize(m);
    if (post_ahead) io_.expect(p_.expected_receives(order_));
  }

  const std::vector<PipeTask>& order() const { return order_; }

  void run(const PipeTask& t) {
    const int i = t.microbatch, c = t.chunk;
    const auto ui = static_cast<size_t>(i);
    const size_t k = ui * v_ + static_cast<size_t>(c);
    if (t.forward()) {
      forward(i, c, k);
    } else if (t.pass == Pass::kInputGrad) {
      at::Tensor grad =
          p_.last_of_model(c) ? at::ones_like(losses_[ui]) : receive_gradient(i, c, outputs_[k]);
      at::Tensor input_grad = halves_->input_gradient(graphs_[ui], grad);
      if (!p_.first_of_model(c)) {
        io_.send(input_grad, p_.previous_rank(), gradient_tag(p_.input_id(i, c)));
      }
      outputs_[k] = inputs_[k] = at::Tensor();
    } else if (t.pass == Pass::kWeightGrad) {
      halves_->weight_gradient(graphs_[ui]);
    } else {
      p_.backward(io_, i, c, i == last_backward_, inputs_[k], outputs_[k], losses_[ui],
                  p_.last_of_model(c) ? at::Tensor() : receive_gradient(i, c, outputs_[k]));
      outputs_[k] = inputs_[k] = at::Tensor();
    }
  }

  // After the last task: the sends are done, the shapes recorded; the loss on the last stage.
  at::Tensor finish() {
    io_.wait();
    io_.check_all_received();
    p_.shape_messages_ += io_.shapes_sent;
    p_.shaped_count_ = agreed_.count;
    p_.shaped_key_ = agreed_.key;
    p_.shapes_valid_ = true;
    if (!last_) return {};
    at::Tensor sum = losses_[0].detach().cpu();
    for (size_t i = 1; i < losses_.size(); ++i) sum = sum + losses_[i].detach().cpu();
    return sum;
  }

 private:
  void forward(int i, int c, size_t k) {
    const auto ui = static_cast<size_t>(i);
    const auto& device = p_.options_.device;
    inputs_[k] = p_.first_of_model(c)
                     ? xs_[ui].to(device)
                     : io_.recv_activation(p_.previous_rank(), p_.input_id(i, c), p_.which(i, c),
                                           &p_.received_shapes_, agreed_.reuse)
                           .requires_grad_(true);
    outputs_[k] = split_ ? halves_->forward(inputs_[k], graphs_[ui])
                         : p_.chunks_[static_cast<size_t>(c)]->forward(inputs_[k]);
    if (p_.last_of_model(c)) {
      const double share = static_cast<double>(ys_[ui].size(0)) / total_;
      losses_[ui] = loss_fn_(outputs_[k], ys_[ui].to(device)) * share;
      if (split_) graphs_[ui].back().out = losses_[ui];
    } else {
      io_.send_activation(outputs_[k], p_.next_rank(), p_.output_id(i, c), &p_.sent_shapes_,
                          agreed_.reuse);
    }
  }

  // The gradient of output k (micro-batch i, chunk c), from the next stage.
  at::Tensor receive_gradient(int i, int c, const at::Tensor& output) {
    const int tag = gradient_tag(p_.output_id(i, c));
    if (auto g = io_.posted(tag, "gradient of " + p_.which(i, c))) return *g;
    at::Tensor grad = gradient_buffer(output);
    io_.recv(grad, p_.next_rank(), tag, "gradient of " + p_.which(i, c));
    return grad;
  }

  DistPipeline& p_;
  const LossFn& loss_fn_;
  Transfers io_;
  bool first_ = false, last_ = false;
  std::vector<at::Tensor> xs_, ys_;
  Agreed agreed_;
  double total_ = 0;
  std::vector<PipeTask> order_;
  int last_backward_ = -1;  // the micro-batch whose backward averages gradients (grids)
  size_t v_ = 1;
  std::vector<at::Tensor> inputs_, outputs_, losses_;
  bool split_ = false;
  std::optional<SplitStage> halves_;
  std::vector<SplitStage::Graphs> graphs_;
};

at::Tensor DistPipeline::train_step(const at::Tensor& input, const at::Tensor& target,
                                    const LossFn& loss_fn) {
  Step step(*this, input, target, loss_fn);
  for (const auto& t : step.order()) step.run(t);
  return step.finish();
}

void DistPipeline::backward(Transfers& io, int microbatch, int chunk, bool averages,
                            const at::Tensor& input, const at::Tensor& output,
                            const at::Tensor& loss, const at::Tensor& output_grad) {
  // Grids (Note [Pipeline and DDP]): every backward but the stage's last accumulates locally;
  // the last is announced to DDP just before it runs, so it averages the sum.
  std::optional<DistributedDataParallel::NoSync> local;
  if (options_.ddp != nullptr) {
    if (averages) {
      options_.ddp->prepare_for_backward({output});
    } else {
      local.emplace(*options_.ddp);
    }
  }
  if (last_of_model(chunk)) {
    loss.backward();
  } else {
    output.backward(output_grad);
  }
  if (!first_of_model(chunk)) {
    io.send(input.grad(), previous_rank(), gradient_tag(input_id(microbatch, chunk)));
  }
}

at::Tensor DistPipeline::forward(const at::Tensor& input) {
  torch::NoGradGuard no_grad;
  const bool first = stage_ == 0, last = stage_ == num_stages() - 1;
  const std::vector<at::Tensor> xs = first ? split(input, "input") : std::vector<at::Tensor>{};
  const int count = agree_microbatches(input).count;
  std::vector<at::Tensor> outputs;
  Transfers io(dist_, options_.device);
  // Chunk by chunk: every rank's chunk c runs before any rank's chunk c + 1 needs it.
  for (int c = 0; c < num_chunks(); ++c) {
    for (int i = 0; i < count; ++i) {
      at::Tensor x = first_of_model(c) ? xs[static_cast<size_t>(i)].to(options_.device)
                                       : io.recv_activation(previous_rank(), input_id(i, c),
                                                            which(i, c), nullptr, false);
      at::Tensor out = chunks_[static_cast<size_t>(c)]->forward(x);
      if (last_of_model(c)) {
        outputs.push_back(out);
      } else {
        io.send_activation(out, next_rank(), output_id(i, c), nullptr, false);
      }
    }
  }
  io.wait();
  return last ? at::cat(outputs) : at::Tensor();
}

}  // namespace scaletrain
