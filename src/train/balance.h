#pragma once
// How the pipeline strategies split a model (internal).

#include <string>
#include <vector>

#include "scaletrain/dist.h"
#include "scaletrain/model.h"
#include "scaletrain/trainer_options.h"

namespace scaletrain {

/// The model's chain of blocks, for `strategy` (the pipeline strategies' stages, fsdp's units);
/// UsageError naming the strategy and what it needs when the model has none (Model::blocks).
torch::nn::Sequential chain_of(const Model& model, Strategy strategy);

/// The blocks per stage of an "N,M,..." --balance list; UsageError for anything but positive
/// whole numbers.
std::vector<int> parse_balance_list(const std::string& spec);

/// Layers per stage: by time (each layer's measured forward and backward on `sample`), by size
/// (parameter bytes), or as listed. Throws UsageError for a list of another length or sum, or a
/// chain of fewer blocks than stages.
std::vector<int> resolve_balance(const Balance& balance, const torch::nn::Sequential& chain,
                                 int stages, const at::Tensor& sample);

/// The same, measured on rank 0 and broadcast, so that every rank of a grid splits alike.
std::vector<int> resolve_balance(const Balance& balance, const torch::nn::Sequential& chain,
                                 int stages, const at::Tensor& sample, const Dist& dist,
                                 const at::Device& device);

}  // namespace scaletrain
