#pragma once
// The two halves of save_checkpoint() (internal), which AsyncCheckpointer runs apart: the
// payload (the serialised state, from tensors that may be the live ones or copies of them) and
// the commit (header with checksum, atomic write, pruning of the run's older files).

#include <torch/optim/optimizer.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/checkpoint.h"

namespace scaletrain {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// The serialised checkpoint (without its header): `state`, the model's `parameters` and
/// `buffers` (by their module names), and `opt`'s state when `opt` is not null.
std::string checkpoint_payload(const TrainingState& state, const NamedTensors& parameters,
                               const NamedTensors& buffers, const torch::optim::Optimizer* opt);

/// Writes `payload` as `dir/ckpt-<global_step>.st` of `run_id` atomically, then removes all but
/// the newest `keep` of that run's checkpoints in `dir`. Returns the path.
std::string commit_checkpoint(const std::string& dir, int64_t global_step,
                              const std::string& run_id, const std::string& payload, int keep,
                              const std::function<void(const std::string&)>& before_rename);

/// load_checkpoint() of a payload (checkpoint_payload()'s) held in memory; `path` names it in
/// errors. The state's run_id is left empty.
TrainingState load_checkpoint_payload(const std::string& payload, const std::string& path,
                                      torch::nn::Module& model, torch::optim::Optimizer* opt,
                                      const std::string& model_name);

/// The module's parameters and buffers by name (the live tensors).
NamedTensors named_parameters_of(const torch::nn::Module& model);
NamedTensors named_buffers_of(const torch::nn::Module& model);

/// Throws UsageError for a run id save_checkpoint() refuses.
void check_run_id(const std::string& run_id);

}  // namespace scaletrain
