#pragma once
// Internal to src/tp: how a split parameter's slice is cut from the whole tensor.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace scaletrain {

/// The slice of `full` that rank `rank` of `ranks` holds along `dim`: `full` cut into `chunks`
/// parts (q, k and v of a fused projection), each part split evenly over the ranks.
at::Tensor split_of(const at::Tensor& full, int64_t dim, int64_t chunks, int rank, int ranks);

}  // namespace scaletrain
