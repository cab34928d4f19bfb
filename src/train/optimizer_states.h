#pragma once
// Note [Standard optimizer state]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Whatever a strategy's optimizer steps (the module's parameters, a tensor-parallel rank's
// slices of them, ZeRO's shards of flat buffers, or both), a gathered checkpoint (dcp, full)
// holds its state as that of the same optimizer (SGD, Adam, AdamW with one parameter group)
// over the whole model's own parameters: a "standard optimizer". A DCP folder then has it under
// get_state_dict()'s names; a ddp run, Python, or the same strategy at any other mesh takes it
// as its own. The strategies get there in two moves, each of which the next dimension reuses:
//   - per parameter, by the module's names: this rank's optimizer state of each parameter it
//     holds (named_states), or ZeRO's, gathered over its group (zero_named_states);
//   - over tensor parallelism: each state tensor's slices joined into the whole one
//     (gather_full_tensors in tensor_parallel.h), and cut again on a load (slice_states).
// Loading runs the other way, from standard_optimizer_to_load()'s optimizer, which the
// checkpoint fills, back into the strategy's own.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>

#include "checkpoint/optimizer_state.h"
#include "scaletrain/dist.h"

namespace scaletrain {

class ShardedDataParallel;

/// Each parameter's state in an optimizer, by name; empty before the first step.
using NamedStates = std::map<std::string, ParamState>;

/// A standard optimizer of `opt`'s kind and options over `module`'s parameters, holding
/// `states` (by the module's names; the parameters they lack hold none), or null where `opt` is
/// not SGD, Adam or AdamW with one parameter group. The module's parameters' devices are kept.
std::unique_ptr<torch::optim::Optimizer> standard_optimizer(const torch::optim::Optimizer& opt,
                                                            torch::nn::Module& module,
                                                            const NamedStates& states = {});

/// `opt`'s state of each of `module`'s parameters that has one, by the module's names.
NamedStates named_states(const torch::optim::Optimizer& opt, torch::nn::Module& module);
/// Makes `states` (by `module`'s names) the state of its parameters in `opt`, each tensor moved
/// to its parameter's device. Throws UsageError naming a parameter whose state is missing
/// while others have one, or is of another shape.
void set_named_states(torch::optim::Optimizer& opt, torch::nn::Module& module,
                      const NamedStates& states);

/// Collective over `zero`'s group: the state of ZeRO's optimizer (over its shards), gathered,
/// per parameter of `module` (the module `zero` shards, or the one whose blocks it chains), by
/// `module`'s names and shaped as the parameters, on their devices.
NamedStates zero_named_states(const ShardedDataParallel& zero, const torch::optim::Optimizer& opt,
                              torch::nn::Module& module);
/// The inverse of zero_named_states(): this rank's shards of `states` into `opt`. Not
/// collective. Returns false (nothing loaded) where a parameter has no state.
bool load_zero_named_states(ShardedDataParallel& zero, torch::optim::Optimizer& opt,
                            torch::nn::Module& module, const NamedStates& states);

/// `states` as bytes (a uint8 tensor on the CPU), for the collectives that carry tensors; and
/// back.
at::Tensor states_to_bytes(const NamedStates& states);
NamedStates states_from_bytes(const at::Tensor& bytes);

/// Collective over `tp`: each state tensor of `split`'s parameters (this rank's slices) joined
/// into the whole parameter's, by the names the whole model has, on the CPU.
NamedStates join_states(torch::nn::Module& split, const Dist& tp, const NamedStates& mine);
/// The inverse of join_states(): this rank's slices of the whole states. Not collective.
NamedStates slice_states(torch::nn::Module& split, const Dist& tp, const NamedStates& whole);

}  // namespace scaletrain
