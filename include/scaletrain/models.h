#pragma once
// The model zoo of the seed tutorials, as LibTorch modules with PyTorch's parameter names.
//
//   ToyModel  10 -> 10 -> ReLU -> 5 (net1, net2), seed 000
//   MLP       in -> hidden -> ReLU -> dropout (p = ModelOptions::dropout, 0 by default) ->
//             classes (fc1, fc2)
//   LeNet     seed 004's: conv 1->20 3x3, ReLU, avg-pool 2, conv 20->50 5x5, ReLU, avg-pool 2,
//             fc 800->128, ReLU, fc 128->10 (conv1, conv2, fc1, fc2); 28x28 inputs
//   resnet18  seed 003's small-image ResNet-18: 3x3 stride-1 stem, no max-pool, BasicBlocks
//             [2,2,2,2], global average pool, fc; torchvision's parameter names
//   gpt-tiny, gpt2-small  a decoder-only transformer with nanoGPT's layout and names (2 layers,
//             4 heads, 64 wide, context 64, bytes; GPT-2's 124M: 12 layers, 12 heads, 768 wide,
//             context 1024, vocabulary 50257), an untied LM head (lm_head) so that every
//             strategy can split it; token ids [batch, positions] to logits [batch, positions,
//             vocabulary]; blocks embed, h0 ..., head
//   resnet50, resnet101  torchvision's (Bottleneck [3,4,6,3] / [3,4,23,3], ImageNet stem);
//             use in_channels 3 and num_classes 1000 for torchvision's exact model
//
// make_model() builds one by name; Model carries the module and its forward, so that trainers
// and wrappers call any of them the same way. as_sequential() gives every model as a chain of
// blocks (ResNets: stem, each residual block, head) sharing its parameters, the form that
// pipelines and partitioners (pipeline.h, schedule.h) split into stages.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace scaletrain {

struct Dist;

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
  /// last dimension is split), what runs after the last backward of an optimizer step (sequence
  /// parallelism's sum of the replicated gradients, over what the step accumulated; under the
  /// trainer's zero1, zero2 and fsdp it is not called, and that sum runs on the gradient shards
  /// instead), and whether the outputs' last dimension is split over the group.
  std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> parallel_loss =
      nullptr;
  std::function<void()> after_backward = nullptr;
  bool output_split = false;
  /// Training FLOPs (forward and backward) of one sample, for the trainer's model FLOPs
  /// utilisation (TrainResult::mfu): the whole model's, however a strategy splits it, and
  /// without what activation checkpointing recomputes. 0: unknown (no MFU is reported). The
  /// zoo's GPTs set it (6·N + 12·L·H·Q·T per token, times the context; docs/training.md).
  int64_t flops_per_sample = 0;
};

struct ModelOptions {
  int64_t num_classes = 10;
  int64_t in_channels = 1;              // image models
  int64_t in_features = 784;            // MLP
  int64_t hidden = 256;                 // MLP
  double dropout = 0;                   // MLP, GPT: the probability of its dropout
  int64_t vocab_size = 0;               // GPT: the vocabulary (0: the size's own)
  int64_t context = 0;                  // GPT: the longest sequence (0: the size's own)
  bool checkpoint_activations = false;  // GPT: each block recomputed in backward, its
                                        // activations not kept (activation_checkpoint.h)
  /// The zoo's model-level CPU optimisations: LeNet's crop of the input to what its pools read
  /// (Note [Unread border]), its fused relu + 2x2 average pool, and the stem convolutions'
  /// weight gradient as one batched product (Note [Stem conv]); each is the plain model's
  /// function. false: LibTorch's own ops only, layer for layer what the Python model writes
  /// (conv, relu, avg_pool2d), as the framework comparison needs.
  bool model_optimizations = true;
};

/// "toy", "mlp", "lenet", "resnet18", "resnet50", "resnet101", "gpt-tiny", "gpt2-small". Throws
/// UsageError naming the known models for any other name.
Model make_model(const std::string& name, const ModelOptions& options = {});

/// The model as a torch::nn::Sequential of blocks whose chained forward equals the model's.
/// The blocks hold the model's own parameter tensors (moving or training one moves or trains
/// the other). Block names: toy "net1", "net2"; mlp "fc1", "fc2"; lenet "conv1", "conv2",
/// "fc1", "fc2"; ResNets "stem", "layer1_0" ... "layer4_<last>", "head".
torch::nn::Sequential as_sequential(const Model& model);

/// The names make_model() knows.
std::vector<std::string> model_names();

/// Puts every 4-D parameter and buffer (convolution weights) in channels-last memory (NHWC),
/// the layout in which oneDNN's CPU convolutions run fastest; feed 4-D inputs as
/// x.contiguous(at::MemoryFormat::ChannelsLast). Values, shapes and names do not change. Call it
/// before wrapping the module in DDP, whose gradient buckets take the parameters' layout.
void to_channels_last(torch::nn::Module& module);

/// Number of elements of all parameters.
int64_t parameter_count(const torch::nn::Module& module);

}  // namespace scaletrain
