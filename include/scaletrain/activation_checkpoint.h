#pragma once
// Activation checkpointing (PyTorch's torch.utils.checkpoint, its reentrant form): a part of the
// forward runs without keeping its intermediate activations, and runs again in backward to
// make them, trading one more forward of that part for its activation memory.
//
//   x = scaletrain::activation_checkpoint([&](const at::Tensor& in) { return block(in); }, x);
//
// Contract. `fn` must compute the same function when called again: the random generators'
// states (the CPU's, and the input device's) are saved before the first call and put back for
// the second, so dropout draws the same mask, and put back as they were afterwards. The
// gradients of the parameters `fn` uses are accumulated into their .grad during the outer
// backward (as any backward does: DDP's hooks fire, and tensor-parallel operators inside `fn`
// communicate again in the recomputation). `input` is the only tensor input the graph sees:
// other tensors `fn` reads that need a gradient must be parameters (leaves). Outside grad mode,
// or when `input` needs no gradient (the graph would not reach fn's parameters through it), it
// is fn(input) as is, nothing recomputed: checkpoint parts after the first layer with weights.

#include <ATen/core/Tensor.h>

#include <functional>

namespace scaletrain {

at::Tensor activation_checkpoint(std::function<at::Tensor(const at::Tensor&)> fn,
                                 const at::Tensor& input);

}  // namespace scaletrain
