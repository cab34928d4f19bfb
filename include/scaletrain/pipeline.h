#pragma once
// Pipelined model parallelism in one process: a torch::nn::Sequential split into stages on a
// list of devices (a device may repeat: "cpu,cpu"), a batch split into micro-batches, and a
// schedule (GPipe, 1F1B, interleaved 1F1B or zero bubble H1, schedule.h) executed by one
// runner with one persistent thread per device.
//
//   scaletrain::PipelineOptions o;
//   o.balance = {2, 3};                       // layers per stage
//   o.devices = {at::kCPU, at::kCPU};         // or cuda:0, cuda:1
//   o.chunks = 4;                             // micro-batches
//   scaletrain::Pipeline pipe(seq, o);        // moves each stage's layers to its device
//   auto loss = pipe.train_step(x, y, [](const at::Tensor& out, const at::Tensor& y) {
//     return torch::nn::functional::cross_entropy(out, y);
//   });                                       // gradients accumulated, then opt.step()
//
// Semantics: the loss of micro-batch i is weighted by its share of the batch, so the gradients
// equal those of loss_fn on the whole batch for losses that average over samples (cross
// entropy, MSE with mean reduction). Inputs go to the first device, targets to the last.
// BatchNorm sees each micro-batch separately (its statistics are per micro-batch, as in
// torchgpipe without deferred batch norm): outputs then differ from the whole-batch module's.
// With checkpointing, the recomputed forward updates BatchNorm's running statistics a second
// time, and a layer drawing random numbers (dropout) draws new ones: use checkpointing with
// deterministic layers, or accept both.
// An exception on a stage thread is raised again on the caller's thread. Not thread-safe: one
// caller at a time. The stage threads live as long as the pipeline: a process forked after a
// step has none of them (as with LibTorch's own thread pools, fork before training, or exec).

#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/balance.h"
#include "scaletrain/schedule.h"

namespace scaletrain {

/// GPipe and 1F1B (schedule.h); kInterleaved1F1B: stages_per_device stages on each device
/// (Megatron-LM's virtual stages, bubble (p-1)/(v·m + p-1)); kZeroBubbleH1: each backward split
/// into its input-gradient and weight-gradient halves, the latter run where 1F1B idles (Qi et
/// al. 2023). Note [Split backward] in src/pipeline/split_backward.cpp says how a stage's
/// backward is split.
enum class PipelineSchedule { kGPipe, k1F1B, kInterleaved1F1B, kZeroBubbleH1 };

/// Activation checkpointing, as torchgpipe names it: a checkpointed micro-batch's forward keeps
/// only the stage's input; its backward runs the forward again, with the graph, first.
/// kExceptLast checkpoints every micro-batch but the last (whose backward follows at once).
enum class PipelineCheckpoint { kNever, kExceptLast, kAlways };

struct PipelineOptions {
  std::vector<int> balance;         // layers per stage; their sum is the model's length
  std::vector<at::Device> devices;  // one per stage (per stages_per_device stages)
  int stages_per_device = 1;        // kInterleaved1F1B: v; stage k runs on devices[k % p], and
                                    // the micro-batch count must be a multiple of p
  int chunks = 1;                   // micro-batches (the last ones may be smaller)
  int64_t split_size = 0;           // >0: micro-batches of this many samples instead (seed
                                    // 000's split_size); the count follows the batch
  PipelineSchedule schedule = PipelineSchedule::kGPipe;
  PipelineCheckpoint checkpoint = PipelineCheckpoint::kNever;
};

using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

class DeviceThreads;  // src/runtime/device_threads.h: one persistent thread per device

class Pipeline {
 public:
  /// Splits `model` by `options.balance` and moves stage k to `options.devices[k % p]`. Throws
  /// UsageError when the balance does not cover the model or devices and stages differ. The
  /// stage threads (one per device) start at the first train_step and live as long as the
  /// pipeline.
  Pipeline(torch::nn::Sequential model, PipelineOptions options);
  ~Pipeline();
  Pipeline(Pipeline&&) noexcept;
  Pipeline& operator=(Pipeline&&) noexcept;

  /// Forward only (no grad needed), micro-batched; returns the outputs joined on the last device.
  at::Tensor forward(const at::Tensor& input);

  /// One training step's forward and backward under the schedule; parameter gradients are
  /// accumulated (call the optimizer afterwards). Returns the whole batch's loss. Throws
  /// UsageError when the target's rows are not the input's (both are cut alike).
  at::Tensor train_step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss);

  const std::vector<torch::nn::Sequential>& stages() const { return stages_; }

 private:
  int chunks_for(int64_t batch) const;
  std::vector<std::vector<PipeTask>> orders(int microbatches) const;
  std::vector<torch::nn::Sequential> stages_;
  PipelineOptions options_;
  std::unique_ptr<DeviceThreads> threads_;
};

/// Splits a batch into `chunks` micro-batches along dimension 0 (sizes differ by at most one,
/// larger first, as torch.chunk does not guarantee); fewer when the batch is smaller.
std::vector<at::Tensor> split_microbatches(const at::Tensor& batch, int chunks);

}  // namespace scaletrain
