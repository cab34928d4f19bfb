#include "pipeline/stage_runner.h"

#include <ATen/ops/ones_like.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <utility>

namespace scaletrain {

StageRunner::StageRunner(std::vector<Chunk> chunks, at::Device device, PipelineSchedule schedule,
                         PipelineCheckpoint checkpoint, StageLink& link, const LossFn& loss_fn,
                         const StageStep& step, AroundBackward around)
    : chunks_(std::move(chunks)),
      device_(device),
      checkpoint_(checkpoint),
      link_(link),
      loss_fn_(loss_fn),
      step_(step),
      around_(std::move(around)),
      m_(static_cast<size_t>(step.microbatches)),
      inputs_(chunks_.size() * m_),
      outputs_(chunks_.size() * m_),
      losses_(m_),
      split_(schedule == PipelineSchedule::kZeroBubbleH1),
      graphs_(split_ ? chunks_.size() * m_ : 0) {
  if (split_) {
    for (const auto& c : chunks_) splits_.emplace_back(c.module);
  }
}

size_t StageRunner::slot(int i, int c) const {
  return static_cast<size_t>(c) * m_ + static_cast<size_t>(i);
}

bool StageRunner::checkpointed(int i) const {
  return checkpoint_ == PipelineCheckpoint::kAlways ||
         (checkpoint_ == PipelineCheckpoint::kExceptLast && static_cast<size_t>(i) + 1 < m_);
}

void StageRunner::run(const PipeTask& t) {
  const int i = t.microbatch, c = t.chunk;
  const size_t k = slot(i, c);
  const Chunk& chunk = chunks_[static_cast<size_t>(c)];
  switch (t.pass) {
    case Pass::kForward: {
      const auto ui = static_cast<size_t>(i);
      inputs_[k] = chunk.first ? step_.inputs[ui].to(device_)
                               : link_.input(i, c).to(device_).requires_grad_(true);
      if (checkpointed(i)) {
        at::NoGradGuard no_graph;  // keep the input only; B or I recomputes
        forward(i, c);
      } else {
        forward(i, c);
      }
      if (!chunk.last) link_.output(i, c, outputs_[k]);
      if (checkpointed(i)) outputs_[k] = at::Tensor();
      break;
    }
    case Pass::kBackward: {
      recompute(i, c);
      const at::Tensor grad = start_gradient(i, c);
      const at::Tensor start = chunk.last ? losses_[static_cast<size_t>(i)] : outputs_[k];
      const std::function<void()> backward = [&] { start.backward(grad); };
      if (around_) {
        around_(i, c, outputs_[k], backward);
      } else {
        backward();
      }
      if (!chunk.first) link_.input_grad(i, c, inputs_[k].grad());
      outputs_[k] = inputs_[k] = at::Tensor();
      break;
    }
    case Pass::kInputGrad: {
      recompute(i, c);
      const at::Tensor g =
          splits_[static_cast<size_t>(c)].input_gradient(graphs_[k], start_gradient(i, c));
      if (!chunk.first) link_.input_grad(i, c, g);
      outputs_[k] = inputs_[k] = at::Tensor();
      break;
    }
    case Pass::kWeightGrad:
      splits_[static_cast<size_t>(c)].weight_gradient(graphs_[k]);
      break;
  }
}

// Forward of chunk c on micro-batch i from its stored input; the model's last chunk adds the
// loss, weighted by the micro-batch's share of the batch.
void StageRunner::forward(int i, int c) {
  const size_t k = slot(i, c);
  Chunk& chunk = chunks_[static_cast<size_t>(c)];
  if (split_ && torch::GradMode::is_enabled()) {
    outputs_[k] = splits_[static_cast<size_t>(c)].forward(inputs_[k], graphs_[k]);
  } else {
    outputs_[k] = chunk.module->forward(inputs_[k]);
  }
  if (!chunk.last) return;
  const auto ui = static_cast<size_t>(i);
  const at::Tensor& y = step_.targets[ui];
  const double share = static_cast<double>(y.size(0)) / step_.total;
  losses_[ui] = loss_fn_(outputs_[k], y.to(device_)) * share;
  if (split_ && graphs_[k].out.defined()) graphs_[k].out = losses_[ui];
}

// Under activation checkpointing, the forward again, now recording the graph.
void StageRunner::recompute(int i, int c) {
  if (checkpointed(i)) forward(i, c);
}

// The gradient the backward of (i, c) starts from: ones for the loss, else the next stage's.
at::Tensor StageRunner::start_gradient(int i, int c) {
  if (chunks_[static_cast<size_t>(c)].last) {
    return at::ones_like(losses_[static_cast<size_t>(i)]);
  }
  return link_.output_grad(i, c, outputs_[slot(i, c)]);
}

at::Tensor StageRunner::loss() const {
  bool last = false;
  for (const auto& c : chunks_) last = last || c.last;
  if (!last || losses_.empty()) return {};
  at::Tensor sum = losses_[0].detach().cpu();
  for (size_t i = 1; i < losses_.size(); ++i) sum = sum + losses_[i].detach().cpu();
  return sum;
}

}  // namespace scaletrain
