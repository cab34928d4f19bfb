#pragma once
// The one runner of a pipeline schedule's tasks (internal): Pipeline (stages on threads of one
// process) and DistPipeline (stages on ranks) both run each stage's F, B, I and W through it,
// and differ only in how a stage reaches its neighbours — a StageLink.
//
// Note [Pipeline runner]: a stage's input is the previous stage's output, detached and on this
// stage's device, so that each stage's backward is its own autograd graph; the gradient of that
// input is what the previous stage's backward starts from. The last stage of the model adds the
// loss, each micro-batch's weighted by its share of the batch's samples, so that the sum over
// micro-batches is the whole batch's mean loss and the gradients those of one big batch.
//   F  forward of micro-batch i: its input (the batch's slice, or from the link), the output
//      (to the link, or the loss); under activation checkpointing no graph is kept, only the
//      input, and B or I recomputes the forward first
//   B  backward from the output's gradient (from the link; ones for the loss) into the
//      parameters and the input, whose gradient goes to the link
//   I  B's input half under zero bubble H1, W its parameter half (Note [Split backward])
// The runner assumes its caller runs a task only once the data it reads is there (Pipeline's
// TaskBoard; DistPipeline's receives, which wait).

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <optional>
#include <vector>

#include "pipeline/split_backward.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/schedule.h"

namespace scaletrain {

/// How a runner's chunks reach the neighbouring stages. `i` is the micro-batch, `c` the chunk of
/// the runner (its index in StageRunner's chunks).
class StageLink {
 public:
  virtual ~StageLink() = default;
  /// The input of chunk c for micro-batch i: the previous stage's output (not for the model's
  /// first chunk).
  virtual at::Tensor input(int i, int c) = 0;
  /// Chunk c's output, for the next stage (not for the model's last chunk).
  virtual void output(int i, int c, const at::Tensor& out) = 0;
  /// The gradient of chunk c's output `out`, from the next stage (not for the model's last).
  virtual at::Tensor output_grad(int i, int c, const at::Tensor& out) = 0;
  /// The gradient of chunk c's input, for the previous stage (not for the model's first chunk);
  /// undefined where the input needed none.
  virtual void input_grad(int i, int c, const at::Tensor& grad) = 0;
};

/// One step's work of a runner's chunks. `inputs` and `targets` are the batch's micro-batches
/// (needed where a chunk is the model's first, resp. last); `total` is the batch's samples.
struct StageStep {
  std::vector<at::Tensor> inputs, targets;
  double total = 0;
  int microbatches = 0;
};

class StageRunner {
 public:
  struct Chunk {
    torch::nn::Sequential module;
    bool first = false;  // the model's first blocks: reads the batch
    bool last = false;   // the model's last blocks: adds the loss
  };
  /// Runs a backward (B, or I's recompute-free part) of micro-batch i, chunk c, whose output is
  /// `output`, by calling `backward`: the place for DDP's hooks around it (grids).
  using AroundBackward = std::function<void(int i, int c, const at::Tensor& output,
                                            const std::function<void()>& backward)>;

  StageRunner(std::vector<Chunk> chunks, at::Device device, PipelineSchedule schedule,
              PipelineCheckpoint checkpoint, StageLink& link, const LossFn& loss_fn,
              const StageStep& step, AroundBackward around = nullptr);

  /// Runs task `t` (its chunk: t.chunk).
  void run(const PipeTask& t);
  /// The sum of the micro-batches' weighted losses (the batch's mean), detached on the CPU;
  /// undefined when no chunk here is the model's last.
  at::Tensor loss() const;

 private:
  size_t slot(int i, int c) const;
  bool checkpointed(int i) const;
  void forward(int i, int c);
  void recompute(int i, int c);
  at::Tensor start_gradient(int i, int c);

  std::vector<Chunk> chunks_;
  at::Device device_;
  PipelineCheckpoint checkpoint_;
  StageLink& link_;
  const LossFn& loss_fn_;
  const StageStep& step_;
  AroundBackward around_;
  const size_t m_;
  // [chunk · m + micro-batch]: the chunk's (detached) input and its output; the losses.
  std::vector<at::Tensor> inputs_, outputs_, losses_;
  // Zero bubble H1: each chunk's backward split in two, and each micro-batch's graph.
  const bool split_;
  std::vector<SplitStage> splits_;
  std::vector<SplitStage::Graph> graphs_;
};

}  // namespace scaletrain
