#include "scaletrain/dist_pipeline.h"

#include "dist/p2p.h"
#include "pipeline/stage_runner.h"
#include "pipeline/transfers.h"

#include <ATen/ATen.h>

#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/schedule.h"

#include <algorithm>
#include <optional>

namespace scaletrain {

using namespace pipeline_messages;

namespace {

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

PointToPoint& DistPipeline::p2p() {
  if (!p2p_) {
    PointToPointOptions o;
    o.shared_memory = options_.shared_memory;
    p2p_ = std::make_shared<PointToPoint>(dist_, std::vector<int>{previous_rank(), next_rank()},
                                          options_.device, o);
  }
  return *p2p_;
}

std::string DistPipeline::transport() const {
  std::vector<int> peers;
  for (int r : {previous_rank(), next_rank()}) {
    if (r != dist_.rank()) peers.push_back(r);
  }
  if (!p2p_ || peers.empty()) return "";
  const auto shared =
      std::count_if(peers.begin(), peers.end(), [&](int r) { return p2p_->shared(r); });
  if (shared == 0) return dist_.backend_name;
  return shared == static_cast<std::ptrdiff_t>(peers.size()) ? "shared memory" : "mixed";
}

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
    p2p().recv(in, prev, kCountTag, "micro-batch count from rank " + std::to_string(prev));
    msg = in.cpu();
  }
  const auto key = std::vector<int64_t>(msg.data_ptr<int64_t>() + 2,
                                        msg.data_ptr<int64_t>() + 4 + msg[3].item<int64_t>());
  const bool mine = shapes_valid_ && key == shaped_key_ && msg[0].item<int64_t>() == shaped_count_;
  msg[1] = (stage_ == 0 || msg[1].item<int64_t>() == 1) && mine ? 1 : 0;
  if (next >= 0) {
    p2p().send(msg.to(on), next, kCountTag, "micro-batch count");
    at::Tensor verdict = at::empty({1}, on);
    p2p().recv(verdict, next, kCountTag + 1, "shape verdict from rank " + std::to_string(next));
    msg[1] = verdict.cpu()[0];
  }
  if (prev >= 0) {
    p2p().send(msg.narrow(0, 1, 1).to(on).contiguous(), prev, kCountTag + 1, "shape verdict");
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

// One training step on this stage: the micro-batches, the transfers, and a StageRunner over the
// rank's chunks (Note [Pipeline runner] in stage_runner.h) whose link they are: the runner's
// tasks receive and send through them.
class DistPipeline::Step : public StageLink {
 public:
  Step(DistPipeline& pipe, const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn)
      : p_(pipe), io_(pipe.p2p(), pipe.options_.device) {
    const bool first = p_.stage_ == 0, last = p_.stage_ == p_.num_stages() - 1;
    if (first) step_.inputs = p_.split(input, "input");
    agreed_ = p_.agree_microbatches(input);
    // Note [Shapes once]: the same batch shape as the last step's sends no shapes, and receives
    // are posted ahead (Gloo matches them by tag; NCCL's, in issue order on one stream, would
    // wait for a receive posted before the send it depends on).
    const bool post_ahead = agreed_.reuse && p_.dist_.backend_name != "nccl";
    p_.shapes_valid_ = false;
    if (last) step_.targets = p_.split(target, "target");
    if (last && step_.targets.size() != static_cast<size_t>(agreed_.count)) {
      throw UsageError("rank " + std::to_string(p_.dist_.rank()) +
                       " (last stage): the batch's target has " + std::to_string(target.size(0)) +
                       " samples, the input " + std::to_string(agreed_.count) +
                       " micro-batches' worth: give both stages the same batch");
    }
    step_.total = last ? static_cast<double>(target.size(0)) : 0;
    step_.microbatches = agreed_.count;
    order_ = p_.my_tasks(agreed_.count);
    for (const auto& t : order_) {
      if (!t.forward()) last_backward_ = t.microbatch;
    }
    std::vector<StageRunner::Chunk> chunks;
    for (int c = 0; c < p_.num_chunks(); ++c) {
      chunks.push_back(
          {p_.chunks_[static_cast<size_t>(c)], p_.first_of_model(c), p_.last_of_model(c)});
    }
    runner_.emplace(std::move(chunks), p_.options_.device, p_.options_.schedule,
                    p_.options_.checkpoint, *this, loss_fn, step_, around_backward());
    if (post_ahead) io_.expect(p_.expected_receives(order_));
  }

  const std::vector<PipeTask>& order() const { return order_; }
  void run(const PipeTask& t) { runner_->run(t); }

  // After the last task: the sends are done, the shapes recorded; the loss on the last stage.
  at::Tensor finish() {
    io_.wait();
    io_.check_all_received();
    p_.shape_messages_ += io_.shapes_sent;
    p_.shaped_count_ = agreed_.count;
    p_.shaped_key_ = agreed_.key;
    p_.shapes_valid_ = true;
    return runner_->loss();
  }

  at::Tensor input(int i, int c) override {
    return io_.recv_activation(p_.previous_rank(), p_.input_id(i, c), p_.which(i, c),
                               &p_.received_shapes_, agreed_.reuse);
  }
  void output(int i, int c, const at::Tensor& out) override {
    io_.send_activation(out, p_.next_rank(), p_.output_id(i, c), &p_.sent_shapes_, agreed_.reuse);
  }
  at::Tensor output_grad(int i, int c, const at::Tensor& out) override {
    const int tag = gradient_tag(p_.output_id(i, c));
    if (auto g = io_.posted(tag, "gradient of " + p_.which(i, c))) return *g;
    at::Tensor grad = gradient_buffer(out);
    io_.recv(grad, p_.next_rank(), tag, "gradient of " + p_.which(i, c));
    return grad;
  }
  void input_grad(int i, int c, const at::Tensor& grad) override {
    io_.send(grad, p_.previous_rank(), gradient_tag(p_.input_id(i, c)));
  }

 private:
  // Grids (Note [Pipeline and DDP]): every backward but the stage's last accumulates locally;
  // the last is announced to DDP just before it runs, so it averages the sum.
  StageRunner::AroundBackward around_backward() {
    DistributedDataParallel* ddp = p_.options_.ddp;
    if (ddp == nullptr) return nullptr;
    return [this, ddp](int i, int, const at::Tensor& output, const std::function<void()>& run) {
      if (i == last_backward_) {
        ddp->prepare_for_backward({output});
        run();
      } else {
        DistributedDataParallel::NoSync local(*ddp);
        run();
      }
    };
  }

  DistPipeline& p_;
  Transfers io_;
  StageStep step_;
  Agreed agreed_;
  std::vector<PipeTask> order_;
  int last_backward_ = -1;  // the micro-batch whose backward averages gradients (grids)
  std::optional<StageRunner> runner_;
};

at::Tensor DistPipeline::train_step(const at::Tensor& input, const at::Tensor& target,
                                    const LossFn& loss_fn) {
  Step step(*this, input, target, loss_fn);
  for (const auto& t : step.order()) step.run(t);
  return step.finish();
}

at::Tensor DistPipeline::forward(const at::Tensor& input) {
  torch::NoGradGuard no_grad;
  const bool first = stage_ == 0, last = stage_ == num_stages() - 1;
  const std::vector<at::Tensor> xs = first ? split(input, "input") : std::vector<at::Tensor>{};
  const int count = agree_microbatches(input).count;
  std::vector<at::Tensor> outputs;
  Transfers io(p2p(), options_.device);
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
