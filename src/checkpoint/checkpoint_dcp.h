#pragma once
// A checkpoint as a folder in PyTorch's distributed checkpoint layout (internal; Note [DCP
// checkpoints] in checkpoint_dcp.cpp): what checkpoint.h's functions do for such a folder.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "scaletrain/checkpoint.h"
#include "scaletrain/distributed_checkpoint.h"

namespace scaletrain {

/// Whether `path` names a DCP checkpoint folder's place: `ckpt-<digits>`, no extension.
bool is_dcp_checkpoint_name(const std::string& path);

/// The keys and values of a checkpoint of `s`, `model` and `opt` (views of the live tensors).
DcpState checkpoint_dcp_state(const TrainingState& s, const torch::nn::Module& model,
                              const torch::optim::Optimizer* opt);

/// The training state's keys and values alone (scaletrain.*), for rank 0's part of a checkpoint
/// every rank writes.
DcpState training_dcp_state(const TrainingState& s);

/// get_state_dict()'s param_groups values of `opt` (SGD, Adam, AdamW) over `model`'s parameters,
/// and the state kinds its parameters have in Python (group 0's: "step" first for Adam and
/// AdamW, a float32 0-d tensor), for a checkpoint whose state tensors the ranks write in parts.
/// UsageError for another optimizer or parameters not in `model`.
std::vector<std::pair<DcpKey, DcpValue>> dcp_optimizer_values(const torch::nn::Module& model,
                                                              const torch::optim::Optimizer& opt);
std::vector<std::string> dcp_optimizer_kinds(const torch::optim::Optimizer& opt);

/// Writes `state` as the folder `dir/ckpt-<global_step>` (replacing one of that name) with its
/// record of checksums, atomically; `before_rename` is called with the temporary folder just
/// before its rename. Then prunes the run's checkpoints of both layouts to the newest `keep`.
/// Returns the folder's path.
std::string commit_dcp_checkpoint(const std::string& dir, int64_t global_step,
                                  const std::string& run_id, const DcpState& state, int keep,
                                  const std::function<void(const std::string&)>& before_rename);

/// Collective over `dist`: commit_dcp_checkpoint() of a folder every rank writes its own boxes
/// of (`mine`; rank 0's holds the values and the training state). Rank 0 writes the record and
/// prunes. Every rank must see `dir` (a shared file system, as Python's dcp.save needs).
std::string commit_distributed_dcp_checkpoint(const std::string& dir, int64_t global_step,
                                              const std::string& run_id, const DcpState& mine,
                                              int keep, const Dist& dist);

/// What is wrong with a checkpoint folder (its record missing, a file missing, short or with
/// another checksum), or nullopt.
std::optional<std::string> dcp_checkpoint_problem(const std::string& folder);
/// The run of a checkpoint folder, from its record; nullopt when it has none.
std::optional<std::string> dcp_checkpoint_run(const std::string& folder);
/// TrainingState::values[key] of a checkpoint folder; nullopt when unreadable or absent.
std::optional<std::string> dcp_checkpoint_value(const std::string& folder, const std::string& key);
/// load_checkpoint() of a folder, also of one another program wrote (Note [Foreign DCP
/// folders]).
TrainingState load_dcp_checkpoint(const std::string& folder, torch::nn::Module& model,
                                  torch::optim::Optimizer* opt, const std::string& model_name);

/// Removes all but the newest `keep` of `run_id`'s checkpoints in `dir`, files and folders
/// alike; other runs' are never touched.
void prune_checkpoints(const std::string& dir, const std::string& run_id, int keep);

}  // namespace scaletrain
