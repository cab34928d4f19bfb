#include "scaletrain/dist_pipeline.h"

#include <ATen/ATen.h>

#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/schedule.h"

namespace scaletrain {

namespace {

// Tags of the point-to-point messages of micro-batch i: the activation's shape, the
// activation, the gradient. Messages between two ranks on one tag arrive in order.
int shape_tag(int i) { return 3 * i; }
int activation_tag(int i) { return 3 * i + 1; }
int gradient_tag(int i) { return 3 * i + 2; }

constexpr int kMaxDims = 8;

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
// forwards bypass DDP, and DDP's forward is called on the stored output of the micro-batch
// whose backward comes last, just before that backward: the reducer arms, the backward's hooks
// find the gradients accumulated by the earlier (no_sync) backwards in the buckets, and the
// all-reduce averages their sum over the replicas.
at::Tensor DistPipeline::train_step(const at::Tensor& input, const at::Tensor& target,
                                    const LossFn& loss_fn) {
  const int p = num_stages(), m = options_.chunks, s = stage_;
  const bool first = s == 0, last = s == p - 1;
  const auto& dev = options_.device;
  const int prev = first ? -1 : options_.stage_ranks[static_cast<size_t>(s - 1)];
  const int next = last ? -1 : options_.stage_ranks[static_cast<size_t>(s + 1)];
  auto need_batch = [&](const at::Tensor& t, const char* what) {
    if (!t.defined() || t.size(0) < m) {
      throw UsageError(std::string("rank ") + std::to_string(dist_.rank()) + " (stage " +
                       std::to_string(s) + ") needs the batch's " + what + " with at least " +
                       std::to_string(m) + " samples (one per micro-batch)");
    }
  };
  std::vector<at::Tensor> xs, ys;
  if (first) {
    need_batch(input, "input");
    xs = split_microbatches(input, m);
  }
  double total = 0;
  if (last) {
    need_batch(target, "target");
    ys = split_microbatches(target, m);
    total = static_cast<double>(target.size(0));
  }
  const ScheduleTable table = options_.schedule == PipelineSchedule::kGPipe
                                  ? gpipe_schedule(p, m)
                                  : one_f_one_b_schedule(p, m);
  std::vector<PipeTask> order;
  for (const auto& row : table) {
    if (row[static_cast<size_t>(s)]) order.push_back(*row[static_cast<size_t>(s)]);
  }
  int last_backward = -1;  // the micro-batch whose backward averages gradients (grids)
  for (const auto& t : order) {
    if (!t.forward) last_backward = t.microbatch;
  }

  std::vector<at::Tensor> inputs(static_cast<size_t>(m)), outputs(static_cast<size_t>(m)),
      losses(static_cast<size_t>(m));
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  std::vector<std::vector<at::Tensor>> in_flight;  // tensors of pending sends
  auto send = [&](at::Tensor t, int to, int tag) {
    in_flight.push_back({t.contiguous()});
    sends.push_back(dist_.backend->send(in_flight.back(), to, tag));
  };
  auto recv = [&](at::Tensor t, int from, int tag, const std::string& what) {
    std::vector<at::Tensor> v{t};
    wait_for(dist_.backend->recv(v, from, tag), what + " from rank " + std::to_string(from), dist_);
  };
  for (const auto& t : order) {
    const auto i = static_cast<size_t>(t.microbatch);
    if (t.forward) {
      at::Tensor x;
      if (first) {
        x = xs[i].to(dev);
      } else {
        // NCCL moves device tensors only: the shape travels on the stage's device there.
        const bool nccl = dist_.backend_name == "nccl";
        auto shape =
            at::empty({kMaxDims + 2}, at::TensorOptions(at::kLong).device(nccl ? dev : at::kCPU));
        recv(shape, prev, shape_tag(t.microbatch), "shape of micro-batch " + std::to_string(i));
        shape = shape.cpu();
        const int64_t dims = shape[0].item<int64_t>();
        const auto dtype = static_cast<at::ScalarType>(shape[1].item<int64_t>());
        std::vector<int64_t> sizes(shape.data_ptr<int64_t>() + 2,
                                   shape.data_ptr<int64_t>() + 2 + dims);
        x = at::empty(sizes, at::TensorOptions().dtype(dtype).device(dev));
        recv(x, prev, activation_tag(t.microbatch),
             "activation of micro-batch " + std::to_string(i));
        x.requires_grad_(true);
      }
      inputs[i] = x;
      outputs[i] = stage_module_->forward(x);
      if (last) {
        const double share = static_cast<double>(ys[i].size(0)) / total;
        losses[i] = loss_fn(outputs[i], ys[i].to(dev)) * share;
      } else {
        const at::Tensor out = outputs[i].detach();
        if (out.dim() > kMaxDims) throw Error("pipeline activations have at most 8 dimensions");
        auto shape = at::zeros({kMaxDims + 2}, at::kLong);
        shape[0] = out.dim();
        shape[1] = static_cast<int64_t>(out.scalar_type());
        for (int64_t d = 0; d < out.dim(); ++d) shape[d + 2] = out.size(d);
        send(dist_.backend_name == "nccl" ? shape.to(dev) : shape, next, shape_tag(t.microbatch));
        send(out, next, activation_tag(t.microbatch));
      }
    } else {
      // Grids (Note [Pipeline and DDP]): every backward but the stage's last accumulates
      // locally; the last is announced to DDP just before it runs, so it averages the sum.
      std::optional<DistributedDataParallel::NoSync> local;
      if (options_.ddp != nullptr) {
        if (t.microbatch == last_backward) {
          options_.ddp->prepare_for_backward({outputs[i]});
        } else {
          local.emplace(*options_.ddp);
        }
      }
      if (last) {
        losses[i].backward();
      } else {
        auto grad = at::empty_like(outputs[i]);
        recv(grad, next, gradient_tag(t.microbatch),
             "gradient of micro-batch " + std::to_string(i));
        outputs[i].backward(grad);
      }
      if (!first) send(inputs[i].grad(), prev, gradient_tag(t.microbatch));
      outputs[i] = at::Tensor();
      inputs[i] = at::Tensor();
    }
  }
  for (auto& w : sends) wait_for(w, "a pipeline send", dist_);
  if (!last) return {};
  at::Tensor sum = losses[0].detach().cpu();
  for (size_t i = 1; i < losses.size(); ++i) sum = sum + losses[i].detach().cpu();
  return sum;
}

}  // namespace scaletrain
