#pragma once
// One parameter's optimizer state as named tensors and a step count (internal): what sharded
// checkpoints save and reshard, and what ShardedDataParallel::memory() counts. Knows LibTorch's
// SGD (momentum_buffer), Adam and AdamW (exp_avg, exp_avg_sq, max_exp_avg_sq).

#include <torch/optim/optimizer.h>

#include <map>
#include <optional>
#include <string>

namespace scaletrain {

struct ParamState {
  int64_t step = 0;                           // Adam's and AdamW's; 0 for SGD
  std::map<std::string, at::Tensor> tensors;  // the defined ones only
};

/// "sgd", "adam", "adamw", or "" for an optimizer of another type.
std::string optimizer_kind(const torch::optim::Optimizer& opt);

/// `p`'s state in `opt`; nullopt before its first step.
std::optional<ParamState> param_state(const torch::optim::Optimizer& opt, const at::Tensor& p);

/// Makes `state` `p`'s state in `opt` (of kind optimizer_kind(opt), which must be known).
void set_param_state(torch::optim::Optimizer& opt, const at::Tensor& p, const ParamState& state);

}  // namespace scaletrain
