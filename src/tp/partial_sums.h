#pragma once
// For the trainer's strategies (internal): which parameters' sequence-parallel sums they run
// themselves (defer_partial_sums() in tensor_parallel.h; Note [Partial gradients summed in
// backward] in sequence_parallel.cpp).

#include <ATen/core/Tensor.h>

#include "scaletrain/tensor_parallel.h"

namespace scaletrain {

/// Whether `param`'s sum is deferred to the caller (defer_partial_sums()).
bool partial_sum_deferred(const at::Tensor& param);

}  // namespace scaletrain
