#pragma once
// What every data-parallel wrapper does at construction (internal): check that the ranks built
// the same model, and give every rank rank 0's tensors.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "scaletrain/dist.h"

namespace scaletrain {

/// "name dtype [sizes]": one line of the model's description.
std::string describe_param(const std::string& name, const at::Tensor& p);
/// The same for a parameter of `dtype` and `sizes` (a sharded model's masters).
std::string describe_param(const std::string& name, at::ScalarType dtype, at::IntArrayRef sizes);

/// Collective through the store: every rank compares every rank's description (one line per
/// parameter) with rank 0's and throws, on every rank, an Error naming the first parameter that
/// differs and the two ranks. `who` ("ddp", "zero") and `instance` (the per-rank count of such
/// wrappers) key the store.
void verify_same_model(const Dist& d, const std::vector<std::string>& mine, const std::string& who,
                       int instance);

/// Collective: rank `root`'s values of `tensors` on every rank, one message per dtype and
/// device. `what` names it in errors.
void broadcast_coalesced(const Dist& d, const std::vector<at::Tensor>& tensors,
                         const std::string& what, int root = 0);

}  // namespace scaletrain
