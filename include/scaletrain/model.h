#pragma once
// A model as the trainer and the wrappers take it: the module, its forward, its form as a chain
// of blocks (what pipelines and partitioners split into stages: pipeline.h, schedule.h,
// blocks.h) and, where the model can be split over a tensor-parallel group, how
// (tensor_parallel.h). A program builds one around its own module:
//
//   auto net = std::make_shared<NetImpl>();
//   scaletrain::Model model{"net", net, [net](const at::Tensor& x) { return net->forward(x); },
//                           [net] { return net->chain(); }};

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace scaletrain {

struct Dist;
struct ContextSplit;

struct Model {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::function<torch::nn::Sequential()> blocks;  // see as_sequential()
  /// Tensor parallelism (tensor_parallel.h; the trainer's TrainerOptions::tensor_parallel):
  /// splits the module in place over `tp`, with sequence parallelism when asked. Every rank of
  /// the group holds the same weights before. Null: the model cannot be split.
  std::function<void(const Dist& tp, bool sequence_parallel)> parallelize = nullptr;
  /// Once split: the loss of forward's outputs (a vocabulary-parallel cross entropy where the
  /// last dimension is split), what runs after the last backward of an optimizer step, over what
  /// the step accumulated (not under the trainer's zero1, zero2 and fsdp, whose gradients are
  /// in shards by then; sequence parallelism needs nothing here: its plan sums the replicated
  /// gradients in backward, tensor_parallel.h), and whether the outputs' last dimension is split
  /// over the group.
  std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> parallel_loss =
      nullptr;
  std::function<void()> after_backward = nullptr;
  bool output_split = false;
  /// Context parallelism (context_parallel.h; the trainer's TrainerOptions::context_parallel):
  /// from this call on, forward takes this rank's slice of each sequence (split.shard(ids, 1))
  /// and gives the outputs of those tokens, its positions and attention over the whole sequence
  /// (ContextParallelism, ring_attention over `cp`); a null `cp` turns it off. Throws UsageError
  /// for what the model cannot split this way (attention dropout). Null: the model has no
  /// attention to split.
  std::function<void(const Dist* cp, const ContextSplit& split)> context_parallel = nullptr;
  /// Training FLOPs (forward and backward) of one sample, for the trainer's model FLOPs
  /// utilisation (TrainResult::mfu): the whole model's, however a strategy splits it, and
  /// without what activation checkpointing recomputes. 0: unknown (no MFU is reported). The
  /// decoder-only transformer's is 6·N + 12·L·H·Q·T per token, times the context
  /// (docs/training.md).
  int64_t flops_per_sample = 0;
};

/// The model as a torch::nn::Sequential of blocks whose chained forward equals the model's.
/// The blocks hold the model's own parameter tensors (moving or training one moves or trains
/// the other). Throws UsageError when the model has no block form.
torch::nn::Sequential as_sequential(const Model& model);

/// Puts every 4-D parameter and buffer (convolution weights) in channels-last memory (NHWC),
/// the layout in which oneDNN's CPU convolutions run fastest; feed 4-D inputs as
/// x.contiguous(at::MemoryFormat::ChannelsLast). Values, shapes and names do not change. Call it
/// before wrapping the module in DDP, whose gradient buckets take the parameters' layout.
void to_channels_last(torch::nn::Module& module);

/// Number of elements of all parameters.
int64_t parameter_count(const torch::nn::Module& module);

}  // namespace scaletrain
