#pragma once
// The trainer: one loop for every strategy, any model and any data set. `scaletrain train` is
// this trainer with the zoo's models and data sets (TrainOptions, in the command line's own
// target: zoo/scaletrain_zoo.h); a program trains its own model by giving a TrainTask:
//
//   auto dist = scaletrain::init_process_group();
//   scaletrain::TrainTask task;
//   task.model = [] { return scaletrain::model_of(std::make_shared<Net>(), "net"); };
//   task.train_data = scaletrain::in_memory(my_train_set);     // or a torch::data data set
//   task.test_data = scaletrain::in_memory(my_test_set);
//   task.optimizer = [](const std::vector<at::Tensor>& p) {
//     return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
//   };
//   scaletrain::TrainerOptions o;                              // DDP over the ranks
//   o.out_dir = "runs/net";
//   auto result = scaletrain::train(task, o, dist);
//
// Strategies (TrainerOptions::strategy; docs/training.md):
//   ddp       one process per device, DistributedDataParallel across them (any world size)
//   dp        one process, a DataParallel replica per device of `devices` (seed 003)
//   pipeline  one process, the model's block chain split over `devices` (seeds 000, 002)
//   grid      a pipeline of `pipeline_stages` ranks (each stage on `tensor_parallel` ranks), and
//             world / (stages · tensor_parallel) such pipelines in data parallel (DistPipeline,
//             DDP per stage)
//   zero1     one process per device, sharded data parallelism (zero.h): optimizer state sharded
//   zero2     ... and gradients
//   fsdp      ... and parameters (ZeRO stage 3, the model's block chain in units)
// Every rank calls train() with the same task and options. What it does on each: a
// DistributedSampler slice of the data per epoch, loaded by background threads; the strategy's
// step; the optimizer; the learning-rate scheduler once per epoch; the metrics on the test data,
// exact (padding excluded, summed over the ranks); checkpoints with exact resume; metrics.jsonl
// and TensorBoard; a progress bar; a summary with the peak memory and parameters per device,
// and the model FLOPs utilisation where the model states its FLOPs (flops.h).
//
// Files under `out_dir`: ckpt-<step>.st (checkpoints, docs/checkpoint.md: the model's weights
// under PyTorch's names whatever the strategy), metrics.jsonl (docs/training.md),
// events.out.tfevents.* (TensorBoard), model.pt (the final weights for Python's torch.load),
// run.json (the run's identity, Note [Run identity]).

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/data_source.h"
#include "scaletrain/ddp.h"
#include "scaletrain/dist.h"
#include "scaletrain/fault_tolerance.h"
#include "scaletrain/loader.h"
#include "scaletrain/model.h"
#include "scaletrain/module_call.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/trainer_options.h"

namespace scaletrain {

// ---- What is trained --------------------------------------------------------------------------

/// A model of a program's own for the trainer (models.h's Model): its module, its forward, and
/// for the pipeline strategies its block chain (blocks.h). `name` is recorded in checkpoints.
template <typename M>
Model model_of(std::shared_ptr<M> module, std::string name = "model",
               std::function<torch::nn::Sequential()> blocks = {}) {
  static_assert(has_tensor_forward_v<M>, "the trainer calls forward(const at::Tensor&)");
  return {std::move(name), module, tensor_forward(module), std::move(blocks)};
}

/// Where a class-split output's slice lies: classes [offset, offset + the slice's last size) of
/// the whole, the rest on the other ranks of `group` (tensor parallelism's vocabulary split).
struct ClassSlice {
  const Dist* group = nullptr;
  int64_t offset = 0;
};

/// A metric of the test data: a value per sample (1 for right, 0 for wrong...), which the trainer
/// averages over the test set exactly (every sample once, over every rank).
struct Metric {
  using PerSample = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
  using PerSampleSplit = std::function<at::Tensor(const at::Tensor& slice, const at::Tensor& target,
                                                  const ClassSlice& where)>;
  std::string name;
  PerSample per_sample;
  /// Optional: per_sample's values from this rank's slice of a class-split output (every rank of
  /// `where.group` calls it at once, and it may communicate over it). Where every metric of a
  /// task has one, the tensor-parallel strategy evaluates a vocabulary-split output without
  /// gathering it whole on any rank (`weight` then gets the slice); else it gathers the output.
  PerSampleSplit per_sample_split = nullptr;
  /// Optional: each sample's weight in the mean (a sequence's positions whose target is not the
  /// ignore index, so that the mean is one over tokens). Unset: every sample weighs 1.
  PerSample weight = nullptr;
  /// Optional: applied to the mean (perplexity: exp of the mean cross entropy).
  std::function<double(double)> finish = nullptr;
};
/// "test_accuracy": the output's argmax over its last dimension (the classes) is the target
/// (split: the largest of the slices' largest, the lowest class among equals, as argmax picks);
/// for a sequence ([batch, positions, classes] against [batch, positions]), the fraction of its
/// positions that are right, weighted by its positions, those whose target is `ignore_index`
/// left out (PyTorch's cross_entropy default, -100). Throws UsageError for other shapes
/// (check_class_shapes()).
Metric accuracy(int64_t ignore_index = -100);
/// "test_loss": the cross entropy over the classes (the last dimension) per target, mean over
/// every target of the test set that is not `ignore_index` (per token for a sequence).
Metric token_loss(int64_t ignore_index = -100);
/// "test_perplexity": exp of token_loss()'s mean.
Metric perplexity(int64_t ignore_index = -100);
/// Outputs [..., classes] against integer targets [...] (the same leading sizes), as the
/// default loss and accuracy() take them; otherwise UsageError naming both shapes and `who`.
/// (A sequence model whose length equals its vocabulary no longer passes for classes.)
void check_class_shapes(const at::Tensor& output, const at::Tensor& target, const std::string& who);

/// What an epoch ended with, for TrainTask::on_epoch and metrics.jsonl.
struct EpochReport {
  int64_t epoch = 0;  // 1-based
  int64_t global_step = 0;
  double loss = 0;  // mean training loss of the epoch: every step's global-batch loss weighted
                    // by its targets (tokens for text, samples for classes), a resumed epoch's
                    // steps before the resume included whatever layout ran them
  std::map<std::string, double> metrics;
  double seconds = 0;
};

/// What a step ended with, for TrainTask::on_step.
struct StepReport {
  int64_t epoch = 0;          // 1-based
  int64_t step_in_epoch = 0;  // batches of the epoch done, this one included
  int64_t global_step = 0;
  double loss = 0;            // the global batch's loss, the same on every rank and at every
                              // layout (docs/training.md, "Output"); with uneven inputs
                              // (ddp.uneven_inputs join) this rank's own
  bool checkpointed = false;  // a checkpoint of this step was just written
  double grad_norm = 0;       // with TrainerOptions::max_grad_norm: the norm before clipping
};

using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<at::Tensor>& params)>;
using SchedulerFactory =
    std::function<std::unique_ptr<torch::optim::LRScheduler>(torch::optim::Optimizer& optimizer)>;

struct TrainTask {
  /// Builds the model (on the CPU; the trainer moves it): called once per rank, and once more
  /// per further DataParallel replica. Every call must build the same architecture; the weights
  /// come from the first call on rank 0 (or from the checkpoint resumed).
  std::function<Model()> model;
  DataSource train_data, test_data;
  /// The loss of a batch (averaging over its samples): cross entropy by default, over the
  /// output's last dimension (a sequence's every position; check_class_shapes()).
  LossFn loss;
  /// The optimizer over the parameters given: SGD (lr 0.05, momentum 0.9) by default.
  OptimizerFactory optimizer;
  /// A LibTorch learning-rate scheduler (torch::optim::StepLR, CosineLR in lr_schedule.h...),
  /// stepped once when made (PyTorch's convention: construction is step 0, so StepLR(opt, 2,
  /// 0.1) decays for epoch 2 as in Python) and after every epoch; none by default. A resumed run
  /// replays its steps from the optimizer's first learning rate, so schedules that depend on the
  /// epoch alone resume exactly.
  SchedulerFactory scheduler;
  /// Metrics of the test data after each epoch: accuracy() by default.
  std::vector<Metric> metrics;
  /// Called on every rank after each epoch.
  std::function<void(const EpochReport&)> on_epoch;
  /// Called on every rank after each batch, once its checkpoint (if one was due) is written. An
  /// exception thrown from it ends train() with it, the checkpoints written so far kept: throw
  /// on every rank at the same step (a time limit, a test's stop), or the others wait for the
  /// missing rank until the collective timeout. Set on any rank, it makes every rank read each
  /// step's loss as the step ends (Note [Deferred reads]: a GPU then waits for the host once a
  /// step).
  std::function<void(const StepReport&)> on_step;
};

struct DeviceReport {
  std::string device;
  int64_t parameters = 0;         // held there (a replica's, or a stage's)
  int64_t peak_memory_bytes = 0;  // CUDA's peak allocated; the process's peak resident on CPU
};

struct TrainResult {
  // A fault-tolerant replica that came back after the others had finished (it trained nothing
  // more and wrote no model.pt; theirs hold the run's weights). Everything else below is unset.
  bool left_behind = false;
  double test_accuracy = 0;               // metrics["test_accuracy"] when measured
  std::map<std::string, double> metrics;  // the last epoch's
  double final_loss = 0;
  std::vector<double> epoch_seconds;
  double samples_per_second = 0;  // training samples over all ranks
  double tokens_per_second = 0;   // sequences: samples_per_second × the targets per sample
  // Model FLOPs utilisation (flops.h, docs/training.md), where the model states its FLOPs
  // (Model::flops_per_sample; 0 otherwise): achieved = flops_per_sample × samples_per_second
  // (all ranks), against peak_flops per device × the devices (the ranks × this rank's distinct
  // devices). peak_flops: TrainerOptions::peak_flops, or on the CPU the fp32 matmul rate
  // measured per rank (peak_measured; the mean of the ranks', which measured at once); 0 unknown.
  double model_flops_per_second = 0;
  double peak_flops = 0;
  bool peak_measured = false;
  double mfu = 0;  // model_flops_per_second / (peak_flops × devices); 0 when either is unknown
  int64_t global_step = 0;
  std::string last_checkpoint;
  int64_t checkpoints = 0;        // written by this run (on this rank, or gathered to rank 0)
  double checkpoint_seconds = 0;  // what the training waited for them (gathers included)
  std::string metrics_path;
  std::string weights_path;           // model.pt (rank 0)
  std::string device;                 // this rank's (the first of dp's and pipeline's)
  int64_t peak_memory_bytes = 0;      // this rank's device: CUDA peak allocated, or CPU peak RSS
  std::vector<DeviceReport> devices;  // this rank's devices
};

/// Throws UsageError when a live run owns `options.out_dir`, naming its process and host. train()
/// takes the folder on rank 0 for the whole run and refuses a second run the same way; this says
/// so before any rank starts (the command line calls it before it launches its workers). Never
/// call it on a rank of a run that may already train: that run's rank 0 owns the folder.
void require_free_output_folder(const TrainerOptions& options);

/// Trains on this rank; every rank calls it with the same task and options. Rank 0 owns
/// `out_dir` meanwhile (one run per folder at a time; another is refused, naming this one).
TrainResult train(const TrainTask& task, const TrainerOptions& options, const Dist& dist);

}  // namespace scaletrain
