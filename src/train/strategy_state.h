#pragma once
// What a trainer's strategy holds, as a checkpoint sees it (internal): the half of a strategy
// that saves and loads (Note [Strategies] in strategy.cpp). TrainStrategy::state() gives it; the
// trainer's step loop never calls it, and run_checkpoints.cpp calls nothing else of a strategy
// to save or load. The defaults are those of a rank that holds the whole model and steps an
// optimizer over all of it (dp, pipeline, and ddp without tensor parallelism).

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>

#include "scaletrain/amp.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/distributed_checkpoint.h"

namespace scaletrain {

class StrategyState {
 public:
  virtual ~StrategyState() = default;

  /// Collective: every rank's model holds the current weights (a grid gathers its stages, tensor
  /// parallelism joins its slices).
  virtual void gather_weights() {}
  /// After a checkpoint's weights were loaded into the model (a sharded or split strategy takes
  /// its shards or slices from them).
  virtual void weights_loaded() {}
  /// Whether the weights this rank steps are finite (collective for the strategies whose ranks
  /// hold parts of them, which agree on one verdict without gathering).
  virtual bool weights_finite() = 0;

  /// Checkpoints (Note [Standard optimizer state] in optimizer_states.h): the optimizer whose
  /// state goes into the checkpoint's standard place, an SGD, Adam or AdamW over the whole model's
  /// parameters (this rank's own where it steps them all, else one it fills from its slices,
  /// shards or stages; collective), or null where `state` takes it (another optimizer's bytes).
  virtual const torch::optim::Optimizer* saved_optimizer(torch::optim::Optimizer& opt,
                                                         TrainingState& state);
  /// The optimizer a checkpoint's standard optimizer state loads into: this rank's own where it
  /// steps the whole model's parameters, one that restore_optimizer() then takes it from, or
  /// null.
  virtual torch::optim::Optimizer* optimizer_to_load(torch::optim::Optimizer& opt) { return &opt; }
  /// After a load: restores the optimizer from `state` where the file's standard place did not;
  /// returns whether it is restored.
  virtual bool restore_optimizer(torch::optim::Optimizer& opt, const TrainingState& state);
  /// Values a checkpoint keeps of this strategy's layout (a grid's stages), into `state`; each
  /// save calls it, whoever writes.
  virtual void describe_layout(TrainingState&) const {}
  /// Note [Checkpoints every rank writes] in own_boxes.h: this rank's boxes of the whole model's
  /// weights and of the standard optimizer's state over them (DCP keys; parts of the tensors,
  /// views of what the rank holds), for a DCP folder every rank writes, without gathering;
  /// nullopt where the strategy gathers its checkpoint (the default). Not collective.
  virtual std::optional<DcpState> own_boxes(const torch::optim::Optimizer&) { return std::nullopt; }
  /// CheckpointFormat::kSharded (the sharded strategies): collective, writes this rank's shard
  /// with `state` under `dir` and returns its path; and loads the shards of `step` (saved at any
  /// world size, and at tensor-parallel degree `saved_tp`, which may be another than this run's:
  /// Note [Sharded checkpoints at another degree] in reshard.h) into this rank's shards and
  /// `opt`, returning the saved state. With a `writer`, the shard is written in the background
  /// (AsyncCheckpointer). The default refuses, naming the strategies that write them.
  virtual std::string save_sharded(const std::string& dir, const TrainingState& state,
                                   const torch::optim::Optimizer& opt, int keep,
                                   AsyncCheckpointer* writer);
  virtual TrainingState load_sharded(const std::string& dir, int64_t step,
                                     torch::optim::Optimizer& opt, int saved_tp);
  /// The loss scaler, whose state a checkpoint keeps; null where there is none.
  virtual GradScaler* scaler() { return nullptr; }
};

}  // namespace scaletrain
