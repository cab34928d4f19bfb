#pragma once
// Pipeline parallelism across processes: one stage per rank, activations sent forward and
// gradients backward through the process group (Gloo on CPU, NCCL on CUDA), under the same
// schedules as the in-process Pipeline (schedule.h: GPipe, 1F1B or zero bubble H1; not
// interleaved 1F1B, and zero bubble H1 not with `ddp`).
//
//   // ranks 0 and 1 hold the two halves of a model
//   auto seq = scaletrain::as_sequential(model);
//   DistPipelineOptions o;
//   o.stage_ranks = {0, 1};
//   o.chunks = 4;
//   DistPipeline pipe(rank == 0 ? slice(seq, 0, 8) : slice(seq, 8, 18), o, dist);
//   auto loss = pipe.train_step(x /* first stage */, y /* last stage */, cross_entropy);
//
// Data x pipeline grids: give `ddp` a DistributedDataParallel wrapping this stage over the
// ranks that hold the same stage in the other pipeline replicas (new_group in dist.h). Each
// stage's micro-batch backwards then accumulate locally (no_sync) and the stage's last
// backward averages the accumulated gradients over the replicas.
//
// Every micro-batch is a tensor of the batch's dtype; a batch is cut into `chunks` micro-batches,
// or fewer when it has fewer samples (the first stage tells the others how many). A failure on one
// rank makes the others fail at the collective timeout with an error naming the transfer they
// waited for.

#include <torch/nn/modules/container/sequential.h>

#include <vector>

#include "scaletrain/dist.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/schedule.h"

namespace scaletrain {

class DistributedDataParallel;

struct DistPipelineOptions {
  std::vector<int> stage_ranks;  // the ranks of this pipeline's stages, first to last
  int chunks = 1;
  PipelineSchedule schedule = PipelineSchedule::kGPipe;
  at::Device device = at::kCPU;            // this stage's device
  DistributedDataParallel* ddp = nullptr;  // optional, wraps this stage (grids)
};

class DistPipeline {
 public:
  /// `stage`: this rank's layers, moved to options.device. Throws UsageError when this rank is
  /// not in stage_ranks, chunks < 1, the schedule is interleaved 1F1B, or zero bubble H1 comes
  /// with `ddp`.
  DistPipeline(torch::nn::Sequential stage, DistPipelineOptions options, const Dist& dist);

  /// One training step. The first stage passes the batch's `input`, the last its `target`;
  /// other ranks pass undefined tensors. Gradients accumulate in this stage's parameters.
  /// Returns the batch loss on the last stage, an undefined tensor elsewhere.
  at::Tensor train_step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss);

  /// Forward only, micro-batched (no grad): the first stage passes the batch's `input`, the
  /// others an undefined tensor. Returns the batch's outputs on the last stage, undefined
  /// elsewhere. Every stage's rank calls it.
  at::Tensor forward(const at::Tensor& input);

  int stage() const { return stage_; }
  int num_stages() const { return static_cast<int>(options_.stage_ranks.size()); }
  torch::nn::Sequential& module() { return stage_module_; }

 private:
  class Transfers;
  int neighbour(int offset) const;  // the rank of stage + offset, or -1
  std::vector<at::Tensor> split(const at::Tensor& t, const char* what) const;
  int agree_microbatches(const at::Tensor& input);
  std::vector<PipeTask> my_tasks(int microbatches) const;
  void backward(Transfers& io, int microbatch, bool averages, const at::Tensor& input,
                const at::Tensor& output, const at::Tensor& loss);

  torch::nn::Sequential stage_module_;
  DistPipelineOptions options_;
  Dist dist_;
  int stage_ = 0;
};

/// Layers [begin, end) of a Sequential, as a Sequential sharing them.
torch::nn::Sequential slice(const torch::nn::Sequential& model, size_t begin, size_t end);

}  // namespace scaletrain
