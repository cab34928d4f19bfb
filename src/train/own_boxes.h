#pragma once
// Note [Checkpoints every rank writes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A DCP checkpoint (the default format) of a strategy whose ranks hold parts of the model —
// ZeRO's shards, tensor parallelism's slices, both — is written by every rank, each its own
// parts: no optimizer state is gathered, and no rank writes another's part (the weights are
// still assembled in every rank's model at a checkpoint, as the program's on_epoch expects:
// Strategies/StrategyTransparency.*grid*). Every part is described the same way: the region of the
// parameter as the rank holds it (a ZeRO shard's run of a parameter's flattened elements is at
// most 2·dims − 1 boxes, flat_range_boxes() in box.h; a tensor-parallel slice is whole), placed
// in the whole parameter by the slice's placement (one box per chunk of its style,
// slice_placements() in tensor_parallel.h). The weights and each state tensor of the optimizer
// (the same regions) go under the keys of the gathered format; buffers and Adam's step, which
// several ranks hold whole, are written once, by the lowest rank (save_distributed_checkpoint),
// and so are the parts data-parallel replicas share. Python's dcp.load, and scaletrain at any
// layout, read the folder as they read a gathered one: a box intersection. Rank 0 adds the
// training state and get_state_dict()'s param_groups. A background writer (--async-checkpoint),
// an optimizer other than SGD, Adam and AdamW, fault-tolerant replicas, and ranks that do not
// all see the output folder (Run::out_dir_shared()) gather as before.

#include <map>
#include <set>
#include <string>

#include "checkpoint/optimizer_state.h"
#include "scaletrain/distributed_checkpoint.h"
#include "scaletrain/tensor_parallel.h"

namespace scaletrain {

class OwnBoxes {
 public:
  /// The parts of `module`'s parameters (the model this rank trains: whole, or split over `tp`;
  /// null: whole) whose state `opt` holds, by the names of the whole model.
  OwnBoxes(torch::nn::Module& module, const Dist* tp, const torch::optim::Optimizer& opt);

  /// The part `region` of parameter `name` (in the coordinates of the rank's parameter): its
  /// weights (`weight`, shaped as the region) and its optimizer state (`state`'s tensors shaped
  /// the same; a kind it lacks is written as zeros, Adam's step once per parameter).
  void add(const std::string& name, const Box& region, const at::Tensor& weight,
           const ParamState& state);
  /// Every buffer of `module`, whole; or one, by name.
  void add_buffers(torch::nn::Module& module);
  void add_buffer(const std::string& name, const at::Tensor& value);
  DcpState take() { return std::move(out_); }

 private:
  void put(const DcpKey& key, const std::string& name, const Box& region, const at::Tensor& values);

  std::map<std::string, SlicePlacement> placements_;
  std::vector<std::string> kinds_;
  std::set<std::string> stepped_;
  DcpState out_;
};

/// Whether `opt` is one whose state OwnBoxes writes (SGD, Adam, AdamW, one group).
bool writes_own_boxes(const torch::optim::Optimizer& opt);

}  // namespace scaletrain
