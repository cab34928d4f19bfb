#pragma once
// Note [Sharded checkpoints at another degree]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A sharded checkpoint saved at tensor-parallel degree T (slice t's ZeRO shards in
// dir/tp<T>-<t>/, Note [Sharded checkpoints per slice] in run_folder.h; T = 1: ZeRO's own
// folders in dir) resumes at another degree T' (1 included) by way of the whole model:
//   - each slice's shards are read whole on every rank (read_sharded_checkpoint, zero.h: not
//     collective), the parameters and each optimizer moment by the names ZeRO keeps them under;
//   - those names go to the model's own through the map the saving run wrote beside them
//     ("tensor_parallel/names": fsdp keeps a chain's names, "h0.block.attn.qkv.weight" for the
//     model's "h.0.attn.qkv.weight"), and the slices are joined by how each parameter was cut
//     ("tensor_parallel/split", describe_split() in tensor_parallel.h);
//   - the whole weights load as a one-file checkpoint's do (the task's model, then each rank's
//     slice and shards), and the whole moments are cut the same way: this rank's slice of each,
//     laid out in its ZeRO's parameter order, is the full optimizer state its shards take.
// Adam's moments and step go on, so a resume at another degree continues the same run to the
// rounding of the split sums. A checkpoint written before the map and the cuts were kept is
// refused at another degree, naming the degree it loads at.

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/dist.h"
#include "scaletrain/zero.h"

namespace scaletrain {

/// The values a sharded save adds to the state so that another degree can load it: the map of
/// `zero`'s names to those of `zero_model` (the module whose parameters it shards: the task's
/// model, or its split build, which has the same names) and, for a split one, how each
/// parameter is cut.
void describe_for_resharding(const ShardedDataParallel& zero, torch::nn::Module& zero_model,
                             TrainingState& state);

/// The sharded checkpoint of `step` saved at degree `saved_tp` under `dir`, whole, by the model's
/// names. Throws UsageError when it cannot be joined (saved without the map and cuts).
WholeShardedCheckpoint read_whole_checkpoint(const std::string& dir, int64_t step, int saved_tp);

/// Loads `whole` into this rank: the weights into `model` (the task's whole model, by name; the
/// caller then cuts its slices and shards: weights_loaded()), and this rank's part of the moments
/// into the shards of `zero` (over `zero_model`'s parameters) in `opt`, each whole moment cut by
/// `cut` (by the model's names, to this rank's slices). Returns whether the optimizer state was
/// restored (false: another optimizer saved it, and it starts afresh). Throws UsageError naming
/// a parameter the checkpoint lacks or holds in another shape.
bool load_whole_checkpoint(const WholeShardedCheckpoint& whole, torch::nn::Module& model,
                           ShardedDataParallel& zero, torch::nn::Module& zero_model,
                           torch::optim::Optimizer& opt,
                           const std::function<std::map<std::string, at::Tensor>(
                               const std::map<std::string, at::Tensor>&)>& cut);

}  // namespace scaletrain
