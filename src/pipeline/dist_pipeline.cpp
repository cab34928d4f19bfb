#include "scaletrain/dist_pipeline.h"

#include "pipeline/split_backward.h"

#include <ATen/ATen.h>

#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/schedule.h"

#include <optional>

namespace scaletrain {

namespace {

// Tags of the point-to-point messages of micro-batch i: the activation's shape, the
// activation, the gradient. Messages between two ranks on one tag arrive in order.
int shape_tag(int i) { return 3 * i; }
int activation_tag(int i) { return 3 * i + 1; }
int gradient_tag(int i) { return 3 * i + 2; }

constexpr int kMaxDims = 8;
constexpr int kCountTag = 1 << 19;  // the micro-batch count, relayed from the first stage

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
    : stage_module_(std::move(stage)), options_(std::move(options)), dist_(dist) {
  const auto& ranks = options_.stage_ranks;
  auto me = std::find(ranks.begin(), ranks.end(), dist.rank());
  if (me == ranks.end()) {
    throw UsageError("rank " + std::to_string(dist.rank()) +
                     " is not one of the pipeline's stage_ranks; give every stage's rank");
  }
  if (options_.chunks < 1) {
    throw UsageError("chunks must be at least 1, got " + std::to_string(options_.chunks));
  }
  if (options_.schedule == PipelineSchedule::kInterleaved1F1B) {
    throw UsageError(
        "a pipeline across ranks runs GPipe, 1F1B or zero bubble H1; interleaved 1F1B runs in "
        "the in-process Pipeline (pipeline.h)");
  }
  if (options_.schedule == PipelineSchedule::kZeroBubbleH1 && options_.ddp != nullptr) {
    throw UsageError(
        "zero bubble H1 across ranks runs without DDP sub-groups: a grid's stages take GPipe or "
        "1F1B");
  }
  stage_ = static_cast<int>(me - ranks.begin());
  stage_module_->to(options_.device);
}

// Note [Pipeline across ranks]: each rank runs its stage's column of the schedule table in
// order. A forward receives its input (shape, then data) from the previous stage, unless it is
// the first; runs the stage; sends the output on, unless it is the last, which computes the
// loss. A backward receives the gradient of the stage's output from the next stage (the last
// starts from its loss), backpropagates, and sends the gradient of the stage's input back.
// Sends are asynchronous and waited for at the end; receives block. The table orders every
// rank's tasks consistently with the data they need, so the ranks cannot wait on each other in
// a cycle.
// Note [Pipeline and DDP]: DDP expects forward then backward, one pair at a time, while a
// pipeline stage interleaves the forwards and backwards of many micro-batches. So the stage's
// forwards bypass DDP, and the output of the micro-batch whose backward comes last is prepared
// for backward (prepare_for_backward) just before that backward: the reducer arms, the
// backward's hooks find the gradients accumulated by the earlier (no_sync) backwards in the
// buckets, and the all-reduce averages their sum over the replicas.

// The point-to-point messages of one step between neighbouring stages.
class DistPipeline::Transfers {
 public:
  Transfers(const Dist& dist, at::Device device) : dist_(dist), dev_(device) {}
  ~Transfers() = default;
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;

  void send(const at::Tensor& t, int to, int tag) {
    in_flight_.push_back({t.contiguous()});
    sends_.push_back(dist_.backend->send(in_flight_.back(), to, tag));
  }
  void recv(at::Tensor t, int from, int tag, const std::string& what) {
    std::vector<at::Tensor> v{t};
    wait_for(dist_.backend->recv(v, from, tag), what + " from rank " + std::to_string(from), dist_);
  }
  // An activation: its rank, dtype and sizes first (NCCL moves device tensors only: the shape
  // travels on the stage's device there), then the data.
  void send_activation(const at::Tensor& out, int to, int microbatch) {
    const at::Tensor a = out.detach();
    if (a.dim() > kMaxDims) throw Error("pipeline activations have at most 8 dimensions");
    auto shape = at::zeros({kMaxDims + 2}, at::kLong);
    shape[0] = a.dim();
    shape[1] = static_cast<int64_t>(a.scalar_type());
    for (int64_t d = 0; d < a.dim(); ++d) shape[d + 2] = a.size(d);
    send(dist_.backend_name == "nccl" ? shape.to(dev_) : shape, to, shape_tag(microbatch));
    send(a, to, activation_tag(microbatch));
  }
  at::Tensor recv_activation(int from, int microbatch) {
    const bool nccl = dist_.backend_name == "nccl";
    auto shape =
        at::empty({kMaxDims + 2}, at::TensorOptions(at::kLong).device(nccl ? dev_ : at::kCPU));
    const std::string which = "micro-batch " + std::to_string(microbatch);
    recv(shape, from, shape_tag(microbatch), "shape of " + which);
    shape = shape.cpu();
    const int64_t dims = shape[0].item<int64_t>();
    const auto dtype = static_cast<at::ScalarType>(shape[1].item<int64_t>());
    std::vector<int64_t> sizes(shape.data_ptr<int64_t>() + 2, shape.data_ptr<int64_t>() + 2 + dims);
    auto x = at::empty(sizes, at::TensorOptions().dtype(dtype).device(dev_));
    recv(x, from, activation_tag(microbatch), "activation of " + which);
    return x;
  }
  void wait() {
    for (auto& w : sends_) wait_for(w, "a pipeline send", dist_);
    sends_.clear();
    in_flight_.clear();
  }

 private:
  const Dist& dist_;
  at::Device dev_;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends_;
  std::vector<std::vector<at::Tensor>> in_flight_;  // tensors of pending sends
};

int DistPipeline::neighbour(int offset) const {
  const int s = stage_ + offset;
  return s < 0 || s >= num_stages() ? -1 : options_.stage_ranks[static_cast<size_t>(s)];
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
int DistPipeline::agree_microbatches(const at::Tensor& input) {
  auto count = at::full({1}, 0, at::kLong);
  if (stage_ == 0) {
    count.fill_(std::min<int64_t>(options_.chunks, input.defined() ? input.size(0) : 0));
  } else {
    std::vector<at::Tensor> v{count};
    wait_for(dist_.backend->recv(v, neighbour(-1), kCountTag),
             "micro-batch count from rank " + std::to_string(neighbour(-1)), dist_);
  }
  if (stage_ + 1 < num_stages()) {
    std::vector<at::Tensor> v{count};
    wait_for(dist_.backend->send(v, neighbour(+1), kCountTag), "micro-batch count", dist_);
  }
  return static_cast<int>(count.item<int64_t>());
}

// This stage's column of the schedule of `m` micro-batches, in order.
std::vector<PipeTask> DistPipeline::my_tasks(int m) const {
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

at::Tensor DistPipeline::train_step(const at::Tensor& input, const at::Tensor& target,
                                    const LossFn& loss_fn) {
  const bool first = stage_ == 0, last = stage_ == num_stages() - 1;
  const std::vector<at::Tensor> xs = first ? split(input, "input") : std::vector<at::Tensor>{};
  const int count = agree_microbatches(input);
  const auto m = static_cast<size_t>(count);
  const std::vector<at::Tensor> ys = last ? split(target, "target") : std::vector<at::Tensor>{};
  if (last && ys.size() != m) {
    throw UsageError("rank " + std::to_string(dist_.rank()) +
                     " (last stage): the batch's target has " + std::to_string(target.size(0)) +
                     " samples, the input " + std::to_string(m) +
                     " micro-batches' worth: give both stages the same batch");
  }
  const double total = last ? static_cast<double>(target.size(0)) : 0;
  const auto order = my_tasks(count);
  int last_backward = -1;  // the micro-batch whose backward averages gradients (grids)
  for (const auto& t : order) {
    if (!t.forward()) last_backward = t.microbatch;
  }
  std::vector<at::Tensor> inputs(m), outputs(m), losses(m);
  // Zero bubble H1: the backward split into I and W (Note [Split backward]).
  const bool split = options_.schedule == PipelineSchedule::kZeroBubbleH1;
  std::optional<SplitStage> halves;
  if (split) halves.emplace(stage_module_);
  std::vector<SplitStage::Graphs> graphs(m);
  Transfers io(dist_, options_.device);
  for (const auto& t : order) {
    const auto i = static_cast<size_t>(t.microbatch);
    if (t.forward()) {
      inputs[i] = first ? xs[i].to(options_.device)
                        : io.recv_activation(neighbour(-1), t.microbatch).requires_grad_(true);
      outputs[i] =
          split ? halves->forward(inputs[i], graphs[i]) : stage_module_->forward(inputs[i]);
      if (last) {
        const double share = static_cast<double>(ys[i].size(0)) / total;
        losses[i] = loss_fn(outputs[i], ys[i].to(options_.device)) * share;
        if (split) graphs[i].back().out = losses[i];
      } else {
        io.send_activation(outputs[i], neighbour(+1), t.microbatch);
      }
    } else if (t.pass == Pass::kInputGrad) {
      at::Tensor grad = last ? at::ones_like(losses[i]) : at::empty_like(outputs[i]);
      if (!last) {
        io.recv(grad, neighbour(+1), gradient_tag(t.microbatch),
                "gradient of micro-batch " + std::to_string(t.microbatch));
      }
      at::Tensor input_grad = halves->input_gradient(graphs[i], grad);
      if (!first) io.send(input_grad, neighbour(-1), gradient_tag(t.microbatch));
      outputs[i] = inputs[i] = at::Tensor();
    } else if (t.pass == Pass::kWeightGrad) {
      halves->weight_gradient(graphs[i]);
    } else {
      backward(io, t.microbatch, t.microbatch == last_backward, inputs[i], outputs[i], losses[i]);
      outputs[i] = inputs[i] = at::Tensor();
    }
  }
  io.wait();
  if (!last) return {};
  at::Tensor sum = losses[0].detach().cpu();
  for (size_t i = 1; i < losses.size(); ++i) sum = sum + losses[i].detach().cpu();
  return sum;
}

void DistPipeline::backward(Transfers& io, int microbatch, bool averages, const at::Tensor& input,
                            const at::Tensor& output, const at::Tensor& loss) {
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
  if (stage_ == num_stages() - 1) {
    loss.backward();
  } else {
    auto grad = at::empty_like(output);
    io.recv(grad, neighbour(+1), gradient_tag(microbatch),
            "gradient of micro-batch " + std::to_string(microbatch));
    output.backward(grad);
  }
  if (stage_ > 0) io.send(input.grad(), neighbour(-1), gradient_tag(microbatch));
}

at::Tensor DistPipeline::forward(const at::Tensor& input) {
  torch::NoGradGuard no_grad;
  const bool first = stage_ == 0, last = stage_ == num_stages() - 1;
  const std::vector<at::Tensor> xs = first ? split(input, "input") : std::vector<at::Tensor>{};
  const int count = agree_microbatches(input);
  std::vector<at::Tensor> outputs;
  Transfers io(dist_, options_.device);
  for (int i = 0; i < count; ++i) {
    at::Tensor x = first ? xs[static_cast<size_t>(i)].to(options_.device)
                         : io.recv_activation(neighbour(-1), i);
    at::Tensor out = stage_module_->forward(x);
    if (last) {
      outputs.push_back(out);
    } else {
      io.send_activation(out, neighbour(+1), i);
    }
  }
  io.wait();
  return last ? at::cat(outputs) : at::Tensor();
}

}  // namespace scaletrain
