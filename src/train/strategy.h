#pragma once
// The trainer's strategies (internal): what a training step is on this rank, where the batch
// goes, and what this rank holds. Note [Strategies] in strategy.cpp.

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "scaletrain/amp.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/distributed_checkpoint.h"
#include "scaletrain/trainer.h"
#include "train/strategy_state.h"

namespace scaletrain {

/// Where a strategy's rank stands: fixed when the strategy is built.
struct RankPlacement {
  /// Where the batch's inputs and targets go.
  at::Device device = at::kCPU;
  /// Which slice of the data this rank reads: replica `data_rank` of `data_replicas`.
  int data_rank = 0;
  int data_replicas = 1;
  /// Whether step()'s loss on this rank is the one its data replica counts in the global
  /// batch's loss (Note [Global losses] in loss_sums.cpp): one rank per replica. The ranks of a
  /// tensor-parallel group each compute the same loss, and only a grid's last stage computes it.
  bool counts_loss = true;
};

/// One parallel model on this rank: the step, evaluation, parameters and gradient norm; what it
/// holds for checkpoints is its state() (strategy_state.h).
class TrainStrategy {
 public:
  virtual ~TrainStrategy() = default;

  const RankPlacement& placement() const { return placement_; }
  at::Device device() const { return placement_.device; }
  int data_rank() const { return placement_.data_rank; }
  int data_replicas() const { return placement_.data_replicas; }
  bool counts_loss() const { return placement_.counts_loss; }

  /// The parameters this rank's optimizer steps, in the model's order.
  virtual std::vector<at::Tensor> parameters() = 0;
  /// One forward and backward of this rank's batch; gradients accumulate. `sync` is false for
  /// the micro-steps of gradient accumulation but the last. `weight` scales the loss that is
  /// differentiated (1 / accumulate). Returns the batch's loss, not scaled by `weight`, where
  /// this rank computes it, undefined elsewhere.
  virtual at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool sync, double weight) = 0;
  /// What this rank's step() loss of batch targets `y` is a mean over, for the global loss
  /// (Note [Global losses] in loss_sums.cpp): loss_weight(y), or that of the slice of `y` the
  /// rank's loss was taken on (context parallelism).
  virtual at::Tensor loss_weight_of(const at::Tensor& y) const;
  /// Outputs for evaluation (no grad) where this rank has them, undefined elsewhere.
  virtual at::Tensor predict(const at::Tensor& x) = 0;
  /// Outputs for evaluation left split over the classes, where the strategy splits them over a
  /// group (tensor parallelism's vocabulary): this rank's slice and where it lies; nullopt,
  /// computing nothing, where it does not (predict() then).
  struct SplitOutputs {
    at::Tensor slice;
    ClassSlice where;
  };
  virtual std::optional<SplitOutputs> predict_split(const at::Tensor&) { return std::nullopt; }
  /// Collective: whether the gradients of this step are finite on every rank.
  virtual bool gradients_finite();
  /// Note [Deferred reads]: where the verdict of gradients_finite() needs no collective and the
  /// device runs ahead of the host (CUDA), a flag on the device that says it without waiting for
  /// the step: a bool tensor, true when finite. Undefined: the trainer asks gradients_finite().
  virtual at::Tensor gradients_finite_flag() { return {}; }
  /// The sum of the squares of the whole model's averaged gradients, the same on every rank
  /// (collective where ranks hold parts of them: shards, stages, tensor-parallel slices). The
  /// default sums parameters()'s gradients on this rank, which holds them all.
  virtual double gradient_square_sum();
  /// PyTorch's clip_grad_norm_: scales the gradients by max_norm / (norm + 1e-6) where that is
  /// below 1, the norm being the global L2 norm (gradient_square_sum()); returns the norm.
  double clip_gradients(double max_norm);
  /// Steps the optimizer (through the GradScaler where there is one).
  virtual void optimizer_step(torch::optim::Optimizer& opt) { opt.step(); }
  /// Clears the gradients for the next step.
  virtual void zero_grad(torch::optim::Optimizer& opt) { opt.zero_grad(); }
  /// Training or evaluation mode (batch norm, dropout) on every module this rank runs.
  virtual void train_mode(bool on) = 0;
  /// This rank ran out of batches for the epoch (ddp's join).
  virtual void end_epoch() {}
  virtual std::vector<DeviceReport> devices() const = 0;

  /// What this rank holds, for checkpoints.
  virtual StrategyState& state() = 0;

 protected:
  explicit TrainStrategy(const Dist& dist) : dist_(dist) {}
  /// Each strategy's constructor says where its rank stands, once.
  void place(const RankPlacement& p) { placement_ = p; }
  const Dist& dist_;

 private:
  RankPlacement placement_;
};

/// The strategy of `options` for `model` (built by the task; moved to its devices here) on this
/// rank. `sample`: a batch of inputs, for balancing a pipeline by time. `task` gives the loss.
std::unique_ptr<TrainStrategy> make_strategy(const TrainTask& task, const TrainerOptions& options,
                                             const Dist& dist, Model& model,
                                             const at::Tensor& sample);

/// This process's device for the ddp and grid strategies: TrainerOptions::device, unset meaning
/// cuda:<local rank> when GPUs are visible (else the CPU), a CUDA device without an index
/// meaning cuda:<local rank>.
at::Device rank_device(const std::optional<at::Device>& chosen, const Dist& dist);
/// The dp and pipeline strategies' devices: options.devices, or every GPU, else "cpu,cpu".
std::vector<at::Device> local_devices(const TrainerOptions& options);
/// Peak memory on `device`: CUDA's peak allocated there, the process's peak resident on CPU.
int64_t peak_memory(const at::Device& device);
/// Whether every tensor is finite (undefined ones count as finite). One host sync.
bool all_finite(const std::vector<at::Tensor>& tensors);
/// all_finite's verdict as a bool tensor on the first tensor's device, without waiting for it
/// (true for no tensors, on the CPU).
at::Tensor all_finite_flag(const std::vector<at::Tensor>& tensors);
/// A LibTorch archive as bytes (a uint8 tensor on the CPU), and back into `ar`.
at::Tensor archive_bytes(torch::serialize::OutputArchive& ar);
void load_archive_bytes(const at::Tensor& bytes, torch::serialize::InputArchive& ar);
/// An optimizer's state as bytes (its torch::serialize archive), for a checkpoint's tensors where
/// each rank's or stage's optimizer has a place of its own; and back into `opt`.
at::Tensor optimizer_bytes(const torch::optim::Optimizer& opt);
void load_optimizer_bytes(torch::optim::Optimizer& opt, const at::Tensor& bytes);
/// Collective over ranks 0 … senders − 1: each one's `mine` (bytes, any length) gathered on rank
/// 0, by rank, on the CPU; the other ranks send theirs (through `device`: NCCL carries device
/// tensors only) and get nothing back. Point-to-point with tags `tag` and `tag` + 1.
std::vector<at::Tensor> bytes_to_rank_zero(const Dist& dist, const at::Tensor& mine, int senders,
                                           int tag, const at::Device& device);
/// The sum of the squares of the defined tensors' elements, in float64 (one sync per device).
double square_sum(const std::vector<at::Tensor>& tensors);
/// Collective over `dist`: `mine` summed over its ranks, in float64, through `device` (NCCL
/// carries device tensors only).
double sum_over(const Dist& dist, double mine, const at::Device& device);
/// Collective over `dist`: whether `mine` holds on every rank (one verdict for all).
bool on_every_rank(const Dist& dist, bool mine, const at::Device& device);

/// The tensors laid end to end in one 1-D tensor on `device`, for one collective over them all;
/// copy_from_flat() puts such a tensor's pieces back, in the same order.
at::Tensor flat_copy(const std::vector<at::Tensor>& tensors, const at::Device& device);
void copy_from_flat(const at::Tensor& flat, std::vector<at::Tensor>& tensors);

/// Collective over `dist`: every rank's `module` takes rank 0's parameter values (one broadcast,
/// through `device`).
void broadcast_parameters(torch::nn::Module& module, const Dist& dist, const at::Device& device);
/// `to`'s parameters take the values of `from`'s of the same names (a whole model's into a
/// second build of it, before that one is split).
void copy_parameters(torch::nn::Module& from, torch::nn::Module& to);
/// The parameters by name, detached (not copied).
std::map<std::string, at::Tensor> named_values(torch::nn::Module& module);

/// Tensor parallelism's trained model: a second build of the task's, with rank 0's weights of
/// `whole` (collective over `world`, through `device`), split over `tp` by Model::parallelize.
/// UsageError when the model cannot be split.
Model split_build(const TrainTask& task, Model& whole, const Dist& world, const Dist& tp,
                  bool sequence_parallel, const at::Device& device);
/// A split module's parameters that are whole on every tp rank (replicated_parameters()), by
/// their TensorImpl.
std::set<const void*> replicated_set(torch::nn::Module& split);
/// The square sum of `parts` (parts of `params`' gradients, by parameter), a replicated
/// parameter's counted 1/t: it is on every one of the t ranks of the group.
double tp_square_sum(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& parts,
                     const std::set<const void*>& replicated, int t);

}  // namespace scaletrain
