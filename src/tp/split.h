#pragma once
// Internal to src/tp: how a split parameter's slice is cut from the whole tensor.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace scaletrain {

/// The slice of `full` that rank `rank` of `ranks` holds along `dim`: `full` cut into `chunks`
/// parts (q, k and v of a fused projection), each part split evenly over the ranks.
at::Tensor split_of(const at::Tensor& full, int64_t dim, int64_t chunks, int rank, int ranks);

/// A parameter that a plan now splits: if an earlier sequence-parallel plan left it whole and
/// registered its gradient's sum, the sum is turned off (a slice's gradient is whole already;
/// Note [Partial gradients summed in backward] in sequence_parallel.cpp).
void stop_summing_partial_gradients(const at::Tensor& param);

}  // namespace scaletrain
