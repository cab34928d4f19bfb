#pragma once
// Note [Tensor parallelism applied first]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The trainer applies the dimensions of ParallelDims in order (TorchTitan's shape): tensor
// parallelism first, then data parallelism (ddp, or ZeRO's stage) over what it gave. TpApplied is
// the first step's result on one rank, and the data-parallel strategies (ddp_strategy.cpp,
// zero_strategy.cpp) take it whatever the degree:
//   - degree t = TrainerOptions::tensor_parallel.size > 1: the world is the mesh {dp: W/t, tp: t}
//     (row-major: ranks r·t … r·t + t − 1 are replica r's tensor-parallel group). The task's
//     Model (`whole`) stays whole on the CPU: checkpoints, model.pt and resumes read and write it
//     under PyTorch's names, whatever the degree. A second build of it, given the whole one's
//     weights, is split over tp (Model::parallelize) and trains (`trained()`), on the rank's
//     device; its loss is the model's parallel loss (the vocabulary-parallel cross entropy).
//     gather_weights() assembles the split weights into the whole model and weights_loaded()
//     cuts them again, and the optimizer's state is joined and cut the same way (Note
//     [Standard optimizer state] in optimizer_states.h), so a checkpoint saved at one degree
//     resumes at another;
//   - t = 1: `whole` itself trains, on the rank's device, and every step here is the identity:
//     data parallelism runs over the world as it did before there was a tp dimension.
//
// Note [Context parallelism applied after tensor parallelism]
// With TrainerOptions::context_parallel.size c > 1 (ddp, zero1, zero2, fsdp) the world is the
// mesh {dp, cp, tp} (the grid: {dp, cp, pp, tp}): after the split over tp, the trained model is
// given its rank's place in its cp group (Model::context_parallel: its slice of each sequence,
// positions and ring attention; context_parallel.h), and data parallelism runs over dp x cp
// flattened (the "dp" group here: a cp group's ranks hold the same weights and average their
// gradients with the replicas', TorchTitan's rule). A cp group's ranks read the same batch
// (data_rank() is the replica's) and each takes its slice of the inputs and targets
// (context_slice()); each counts its slice's loss, weighted by the slice's targets. Evaluation
// gathers the outputs along the sequence (whole_outputs()). Checkpoints see nothing of it: the
// weights are whole on each cp rank, so a run resumes at any other cp degree.
//
// Note [Expert parallelism applied after context parallelism]
// With TrainerOptions::expert_parallel.size e > 1 (ddp, zero1, zero2, fsdp) the trained model is a
// second build as under tp (the whole one keeps every expert for checkpoints), and each of its MoE
// layers (expert_parallel.h) keeps E / e experts: the ranks of "dp" (dp x cp flattened) in blocks
// of e consecutive ones are the ep groups, and the ranks at the same place of every block, the edp
// groups, hold the same experts. DDP leaves the experts alone (DDPOptions::ignored_parameters);
// after the step's last backward an expert's gradient, the sum over its ep group's tokens, is
// summed over its edp group and divided by dp x cp: DDP's average over every token (with
// sequence parallelism, where each tp rank routes its slice of the sequence, summed over tp
// too). Under zero1, zero2 and fsdp the units leave them out the same way
// (ShardOptions::ignored_parameters) and the optimizer steps them beside the shards: whole under
// zero1 and zero2; under fsdp sharded over their edp group of M ranks (TorchTitan's efsdp:
// dp x cp = efsdp x ep), each rank holding E / (e M) experts, gathered for each forward and their
// gradients reduce-scattered, summed over edp, in backward (MoEImpl::shard_experts), so that only
// the division by dp x cp is left after the last backward. Where M does not divide E / e the
// experts stay whole, and the log says so. The gradient norm adds the experts' square sums over
// the ep group (sharded: over dp x cp, which holds each part once). gather_weights(), join() and
// slice() gather and cut the experts along their first dimension over the ep group, and first
// over edp where sharded (the layer's own groups, tensor_parallel.h's gather_full_state), so
// checkpoints hold experts by their global index and a run resumes at another e and M.
//
// The grid applies it the same way on its mesh {dp, pp, tp} (grid.cpp), then cuts the trained
// model into pipeline stages, then puts DDP over each stage's replicas: tp, then pp, then dp.
// Data: replica r reads slice r of W/t; its tp ranks read the same batch. Metrics are counted
// once per rank, so each replica's are counted t times, numerators and denominators alike: their
// ratios are the replicas' means. The training loss is counted once per replica, on its tp rank
// 0 (Note [Global losses] in loss_sums.cpp), so that its sums mean the same at every layout.
// Sequence parallelism's sum of the replicated gradients over tp runs once per step, after its
// last backward, in one all-reduce (the plan's hooks defer to it, Note [Partial gradients summed
// in backward] in src/tp/sequence_parallel.cpp): over the whole gradients after DDP's average,
// or on ZeRO's gradient shards, where the gradients are by then; the sums over tp and dp
// commute. The gradient norm counts an element of a replicated parameter 1/t on each tp rank.

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "scaletrain/context_parallel.h"
#include "scaletrain/expert_parallel.h"
#include "scaletrain/mesh.h"
#include "scaletrain/parallel_dims.h"
#include "train/optimizer_states.h"
#include "train/strategy.h"

namespace scaletrain {

class ShardedDataParallel;

class TpApplied {
 public:
  /// Collective over `world` where t > 1 (the groups, rank 0's weights). UsageError when the
  /// model cannot be split.
  TpApplied(const TrainTask& task, const TrainerOptions& o, const Dist& world, Model& whole,
            const at::Device& device);
  /// The same on a mesh of the caller's (the grid's {dp, pp, tp}) and its groups, which hold
  /// "dp" and, where t > 1, "tp". The trained build stays on the CPU: the caller moves the parts
  /// this rank trains (a pipeline's stages) to `device`.
  TpApplied(const TrainTask& task, const TrainerOptions& o, const Dist& world, Model& whole,
            const at::Device& device, DeviceMesh mesh, std::map<std::string, Dist> groups);
  /// Turns the model's context parallelism off again.
  ~TpApplied();
  TpApplied(const TpApplied&) = delete;
  TpApplied& operator=(const TpApplied&) = delete;

  /// Whether the trained model is a build of its own: split over tp, or its experts over ep.
  bool split() const { return degree_ > 1 || ep_degree_ > 1; }
  int degree() const { return degree_; }
  /// The model this rank trains: the split build, or the whole model.
  Model& trained() { return split() ? split_ : whole_; }
  const Model& trained() const { return split() ? split_ : whole_; }
  /// Whether evaluation outputs are split over tp (the model's vocabulary-parallel head).
  bool outputs_split() const { return degree_ > 1 && split_.output_split; }
  /// Whether evaluation takes the outputs split over tp as they are (not under context
  /// parallelism, whose outputs are gathered along the sequence: predict()).
  bool evaluates_split() const { return outputs_split() && !context_.on(); }
  /// Context parallelism over `cp` (the caller's group: the grid's), after the split: the
  /// trained model takes its rank's slice of each sequence (Model::context_parallel; UsageError
  /// where it has no hook). The first constructor calls it itself.
  void apply_context(const TrainerOptions& o, const Dist& cp);
  /// This rank's slice of a batch's inputs or targets [batch, sequence, ...] under context
  /// parallelism; the batch itself otherwise.
  at::Tensor context_slice(const at::Tensor& t) const { return context_.shard(t, 1); }
  Model& whole() { return whole_; }
  const LossFn& loss() const { return loss_; }
  /// The data-parallel group (the world at t = 1 without a mesh of the caller's) and this rank's
  /// tensor-parallel group (t > 1).
  const Dist& dp() const { return mesh_ ? groups_.at("dp") : world_; }
  const Dist& tp() const { return groups_.at("tp"); }
  /// This rank's data replica (a context-parallel group's ranks read the same batch).
  int data_rank() const;
  int data_replicas() const;
  // A tp group's ranks compute the same loss of their replica's batch (Note [Global losses]).
  bool counts_loss() const { return !split() || tp().rank() == 0; }
  /// A ddp or sharded strategy's rank over this split, on `device`.
  RankPlacement placement(const at::Device& device) const {
    return {device, data_rank(), data_replicas(), counts_loss()};
  }
  /// Where a collective's tensors go: the device with NCCL, the CPU with Gloo.
  at::Device collective() const;
  /// "dp 2 x tp 2", for the state of an optimizer saved as bytes per rank.
  /// With " ep N" after it where the experts are spread (their optimizer state's shapes differ).
  /// And " efsdp M" where the experts are sharded over their edp group.
  std::string describe() const {
    return (split() ? mesh_->describe() : "dp " + std::to_string(world_.size())) +
           (ep_degree_ > 1 ? " ep " + std::to_string(ep_degree_) : "") +
           (experts_sharded_ ? " efsdp " + std::to_string(edp_->size()) : "");
  }

  /// Evaluation outputs, whole (gathered over tp where the model's outputs are split).
  at::Tensor whole_outputs(const at::Tensor& out) const;
  /// The split outputs and where they lie, where the model's outputs are split over tp.
  std::optional<TrainStrategy::SplitOutputs> split_outputs(const at::Tensor& out) const;

  /// After the step's last backward, with whole gradients on every rank (ddp): sequence
  /// parallelism's sums over tp and the model's after_backward.
  void after_last_backward();
  /// The same under ZeRO (`zero` over `zero_params`, the parameters of what it wraps): the
  /// replicated parameters' parts of this rank's gradient shards summed over tp.
  void after_last_backward(const ShardedDataParallel& zero,
                           const std::vector<at::Tensor>& zero_params);
  /// Expert parallelism (Note [Expert parallelism applied after context parallelism]): the
  /// names of the experts' parameters, which DDP leaves alone; whether `p` is one; their
  /// gradients averaged after the step's last backward (in after_last_backward()), zeroed, and
  /// their square sum over the ep group (collective). Empty, false and 0 at ep 1.
  const std::set<std::string>& expert_names() const { return expert_names_; }
  const std::vector<at::Tensor>& expert_params() const { return expert_params_; }
  /// The experts' optimizer state added to `states` (by the trained build's names), and set
  /// into `opt` from `sliced` (this rank's experts' state, slice()'s), for a strategy whose
  /// other parameters' state is kept elsewhere (ZeRO's shards).
  void add_expert_states(const torch::optim::Optimizer& opt, NamedStates& states) const;
  void set_expert_states(torch::optim::Optimizer& opt, const NamedStates& sliced) const;
  bool is_expert(const at::Tensor& p) const { return experts_.count(p.unsafeGetTensorImpl()) > 0; }
  void zero_expert_gradients();
  double expert_square_sum() const;
  /// The load-balancing losses' gradients scaled by `weight`, as the step scales its loss.
  void set_aux_loss_scale(double weight);
  /// The square sum of `parts` (parts of `params`' gradients, by parameter), a replicated
  /// parameter's counted 1/t (t > 1 only).
  double square_sum(const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& parts) const;
  /// Each parameter's part of this rank's gradient shards of `zero` (views), where they hold one.
  static std::vector<at::Tensor> shard_parts(const ShardedDataParallel& zero,
                                             const std::vector<at::Tensor>& params);

  /// Collective over tp: the whole model takes the split weights (nothing at t = 1).
  void gather_weights();
  /// The same for `parts` of the trained build alone (a pipeline's stages on this rank).
  void gather_weights(const std::vector<torch::nn::Sequential>& parts);
  /// The split build takes its slices of the whole model's weights (nothing at t = 1).
  void weights_loaded();
  /// The optimizer's state of the split parameters joined into the whole model's (collective
  /// over tp), and back (Note [Standard optimizer state]); the identity at t = 1.
  NamedStates join(const NamedStates& mine) const;
  NamedStates slice(const NamedStates& whole) const;
  /// Whole tensors by the model's names cut to this rank's slices.
  std::map<std::string, at::Tensor> cut(const std::map<std::string, at::Tensor>& whole) const;
  /// An optimizer other than SGD, Adam and AdamW, split (Note [Standard optimizer state]): every
  /// rank's bytes into rank 0's `state`, with `layout` (collective); and back into `opt` where
  /// the checkpoint's layout is `layout` (the same mesh and strategy only).
  void save_rank_bytes(const torch::optim::Optimizer& opt, TrainingState& state,
                       const std::string& layout) const;
  bool restore_rank_bytes(torch::optim::Optimizer& opt, const TrainingState& state,
                          const std::string& layout) const;
  /// This slice's folder of sharded checkpoints under `dir` (`dir` at t = 1).
  std::string slice_dir(const std::string& dir) const;

 private:
  const Dist& world_;
  Model& whole_;
  int degree_;
  std::optional<DeviceMesh> mesh_;      // t > 1: {dp, tp}; or the caller's
  std::map<std::string, Dist> groups_;  // "dp" and "tp" where mesh_ is set (t > 1: "tp")
  at::Device device_;
  Model split_;  // t > 1: the trained build, split over tp
  LossFn loss_;
  std::set<const void*> replicated_;  // the split build's parameters whole on every tp rank
  std::vector<at::Tensor> deferred_;  // sequence parallelism's partial sums
  int cp_degree_ = 1;                 // context parallelism's, 1: none
  int ep_degree_ = 1;                 // expert parallelism's, 1: none
  std::optional<Dist> ep_, edp_;      // e > 1: this rank's ep and edp groups
  std::vector<MoEImpl*> moes_;        // the trained model's MoE layers
  std::set<std::string> expert_names_;
  std::vector<std::string> expert_param_names_;  // expert_params_' names, in their order
  bool experts_summed_over_tp_ = false;          // sequence parallelism: each tp rank's tokens
  bool experts_sharded_ = false;                 // fsdp: over edp (MoEImpl::shard_experts)
  std::set<const void*> experts_;
  std::vector<at::Tensor> expert_params_;
  ContextParallelism context_;  // what the trained model was given
  std::function<void(const Dist*, const ContextSplit&)> context_off_;  // its hook, for off

  void build_split(const TrainTask& task, const TrainerOptions& o);
  void apply_context_parallel(const TrainerOptions& o, const ParallelDims& dims);
  void apply_expert_parallel(const ParallelDims& dims, Strategy strategy);
  void reduce_expert_gradients();
};

/// UsageError for expert-parallel options the world or the strategy cannot take.
void validate_expert_parallel(const TrainerOptions& o, int world);

/// UsageError for context-parallel options the world or the strategy cannot take.
void validate_context_parallel(const TrainerOptions& o, int world);

/// UsageError for tensor-parallel options the world or the strategy cannot take.
void validate_tensor_parallel(const TrainerOptions& o, int world);

}  // namespace scaletrain
