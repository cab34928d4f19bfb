#pragma once
// Placing a model's layers on devices by memory, like Hugging Face's device_map="auto" (seed
// 001): layers stay in order, each device is filled up to its budget before the next is used —
// GPUs first, in the order given, then the CPU. A pure function: no LibTorch, no devices.
//
//   auto p = scaletrain::place_layers(layer_bytes, {{"cuda:0", 10 << 30}, {"cpu", 64ll << 30}});
//   // p.balance = {12, 6}, p.devices = {"cuda:0", "cpu"}; std::cout << p.report();
//
// pipeline.h's place_by_memory() measures a Sequential's layers and gives PipelineOptions.

#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain {

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

}  // namespace scaletrain
