#pragma once
// Balancing: which consecutive layers of a chain go to which pipeline stage and device.
//
//   balance_by_cost(costs, stages)      the split that minimises the slowest stage, for any
//                                       per-layer cost (a pure function)
//   balance_by_time(chain, sample, p)   costs measured: each layer's forward and backward
//                                       (torchgpipe's balance_by_time; profile_layers())
//   balance_by_size(chain, p)           costs: each layer's parameter bytes
//   place_layers(bytes, budgets)        by memory, like Hugging Face's device_map="auto" (seed
//                                       001): each device filled up to its budget before the
//                                       next, GPUs first (a pure function)
//   place_by_memory(chain, budgets)     the same on a chain's measured bytes, as PipelineOptions
//
//   auto p = scaletrain::place_layers(layer_bytes, {{"cuda:0", 10 << 30}, {"cpu", 64ll << 30}});
//   // p.balance = {12, 6}, p.devices = {"cuda:0", "cpu"}; std::cout << p.report();
//
// The pure functions need no LibTorch (the LibTorch-free part of the library has them); the
// others take a torch::nn::Sequential of blocks (blocks.h, model.h's as_sequential()).

#include <cstdint>
#include <string>
#include <vector>

namespace at {
class Tensor;
}  // namespace at
namespace torch {
namespace nn {
class Sequential;
}  // namespace nn
}  // namespace torch

namespace scaletrain {

struct PipelineOptions;  // pipeline.h

/// Contiguous partition of layers into `stages` minimising the most expensive stage (costs:
/// measured time, or parameter sizes). Returns layers per stage, each at least 1. Among equally
/// good partitions, the one whose earlier stages are fullest. Throws UsageError when there are
/// fewer layers than stages.
std::vector<int> balance_by_cost(const std::vector<double>& costs, int stages);

struct DeviceBudget {
  std::string device;  // "cuda:0", "cuda:1", ..., "cpu"
  int64_t bytes = 0;   // memory the layers may take there
};

struct Placement {
  std::vector<std::string> layer_device;  // per layer
  std::vector<int> balance;               // consecutive layers per used device (pipeline stages)
  std::vector<std::string> devices;       // the device of each stage
  std::vector<int64_t> stage_bytes;       // bytes placed on each stage's device
  /// One line per device: what went where ("cuda:0: layers 0-11, 9.8 GiB of 10 GiB").
  std::string report() const;
};

/// Places layers in order: a layer goes on the current device while it fits in what is left of
/// the budget, else on the next device. Each budget entry that receives layers is one stage; a
/// device may be listed twice ("cpu", "cpu") to make two stages of it. CUDA devices are used before
/// the CPU whatever the order of `budgets`. Throws UsageError naming the first layer that fits on
/// no remaining device, and for an empty budget list or a negative size.
Placement place_layers(const std::vector<int64_t>& layer_bytes,
                       const std::vector<DeviceBudget>& budgets);

/// One layer's measured cost, as balance_by_time() uses it.
struct LayerProfile {
  double seconds = 0;            // forward + backward, the fastest of the repeats
  int64_t activation_bytes = 0;  // the layer's output for the sample
  int64_t parameter_bytes = 0;   // its parameters and buffers
};

/// Runs `sample` through the layers `repeats` times (after one warm-up), each layer on a graph
/// of its own so that its forward and its backward are timed alone. Leaves no gradients.
std::vector<LayerProfile> profile_layers(const torch::nn::Sequential& model,
                                         const at::Tensor& sample, int repeats = 3);

/// The contiguous balance that minimises the slowest stage (balance_by_cost), with
/// the profiled forward+backward time of each layer as its cost (torchgpipe's balance_by_time).
std::vector<int> balance_by_time(const torch::nn::Sequential& model, const at::Tensor& sample,
                                 int stages, int repeats = 3);
/// The same with each layer's parameter bytes as its cost.
std::vector<int> balance_by_size(const torch::nn::Sequential& model, int stages);

/// device_map="auto" for a Sequential (seed 001): each layer's parameter and buffer bytes are
/// placed by place_layers() — GPUs first, each filled to its budget, then the
/// CPU — and returned as PipelineOptions (balance and devices; chunks and schedule at their
/// defaults). `report`, when given, receives one line per stage: its device, layers, bytes and
/// parameter count.
PipelineOptions place_by_memory(const torch::nn::Sequential& model,
                                const std::vector<DeviceBudget>& budgets,
                                std::string* report = nullptr);

}  // namespace scaletrain
