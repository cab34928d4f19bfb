#pragma once
// The trainer's run (internal): one train() call on one rank, its state and its phases.
// trainer.cpp holds the loop of every strategy; fault_loop.cpp the fault-tolerant replicas'.

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <chrono>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/fault_tolerance.h"
#include "scaletrain/loader.h"
#include "scaletrain/sampler.h"
#include "scaletrain/trainer.h"
#include "train/loss_sums.h"
#include "train/report.h"
#include "train/run_folder.h"
#include "train/strategy.h"

namespace scaletrain {

using Clock = std::chrono::steady_clock;

inline double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// The task with its defaults filled in (loss, optimizer, metrics).
TrainTask completed(TrainTask t);

class Run {
 public:
  Run(const TrainTask& task, const TrainerOptions& o, const Dist& d)
      : task_(completed(task)), o_(o), d_(d), default_loss_(!task.loss) {}
  TrainResult go();

 private:
  void keep_checkpoint_balance();
  void setup();
  void setup_device_side();
  void resume();
  void epoch(int64_t e);
  bool same_batches_everywhere(int64_t e, int64_t batches);
  int stream() const;
  std::string streams_layout() const;
  // The epoch's end on every rank: its loss, the metrics, the scheduler, the checkpoint.
  void end_epoch(int64_t e, double seconds);
  // Fault-tolerant replicas (fault_loop.cpp, Note [Fault-tolerant loop]).
  void train_fault_tolerant();
  bool replica_step(const Batch& b, const Quorum& q, double* loss);
  at::Tensor replica_state();
  void load_replica_state(const at::Tensor& bytes);
  // A step whose results the host has not read yet (Note [Deferred reads] in run_steps.cpp).
  struct Pending {
    at::Tensor loss;    // on the device; undefined where this rank computes none
    at::Tensor weight;  // the targets the loss averages over, where this rank counts it
    at::Tensor finite;  // the gradients' verdict on the device; undefined: checked already
    int64_t done = 0, global_step = 0;
    double lr = 0, seconds = 0;
  };
  Pending step(const Batch& b, bool last_micro, int64_t epoch);
  double settle(int64_t epoch, int64_t batches);
  std::vector<double> over_world(const std::vector<double>& mine);
  bool settle_due(int64_t done, int64_t batches, bool checkpoint) const;
  using Batches = std::function<std::optional<Batch>()>;
  Batches batch_stream(const DataSource& source, const Dataset& rows, std::vector<int64_t> indices,
                       const LoaderOptions& lo) const;
  Dataset rows_on_device(const DataSource& source, const char* split) const;
  std::map<std::string, double> evaluate();
  void save(int64_t epoch, int64_t step_in_epoch);
  void save_now(int64_t epoch, int64_t step_in_epoch);
  void drop_replaced_shards();
  bool out_dir_shared();
  void restore_rank_state();
  void restore_loss_sums();
  void check_model_takes(const Batch& sample);
  void report_differences(const TrainingState& saved);
  std::string resumed_line(const std::string& from, bool optimizer_restored) const;
  at::Device collective_device() const;
  std::string agreed_run_id(const std::string& mine);
  void record_options();
  void settle_peak();
  void finish();
  double lr() const { return opt_->param_groups()[0].options().get_lr(); }
  [[noreturn]] void diverged(const std::string& what, int64_t step, int64_t epoch, double loss);
  LoaderOptions loader_options(int64_t batch, uint64_t seed, int64_t first_batch) const;

  const TrainTask task_;
  TrainerOptions o_;  // a copy: a resume may keep its checkpoint's grid balance
  const Dist& d_;
  std::unique_ptr<FolderLock> folder_lock_;  // rank 0's, for the whole run
  std::unique_ptr<Reporter> reporter_;       // made once the run's folder is settled
  RunStart start_;
  Model model_;
  std::unique_ptr<TrainStrategy> strategy_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::unique_ptr<torch::optim::LRScheduler> scheduler_;
  std::vector<double> first_lrs_;
  std::unique_ptr<DistributedSampler> sampler_;
  int64_t per_replica_ = 0;
  TrainingState state_;
  TrainResult r_;
  int64_t samples_ = 0;
  double train_seconds_ = 0;
  bool default_loss_ = false;       // the task gave no loss: cross entropy over classes
  uint64_t seed_ = 0;               // the data order's: the options', or the resumed run's
  int64_t targets_per_sample_ = 0;  // a sequence's positions (tokens/s), 0 for classes
  double grad_norm_ = 0;            // the last step's gradient norm before clipping (max_grad_norm)
  Dataset train_rows_, test_rows_;  // on the device, with data_on_device
  bool defer_reads_ = false;        // Note [Deferred reads]
  std::vector<Pending> pending_;
  // This rank's part of the epoch's losses so far, a resumed epoch's too (Note [Global losses]).
  LossSum loss_sum_;
  bool global_reads_ = true;                // the ranks read the steps' losses together
  std::unique_ptr<ReplicaGroup> replicas_;  // --fault-tolerant
  bool left_behind_ = false;                // the other replicas finished while this one was away
  // Note [Format switch] in run_folder.cpp, rank 0: the folder held shards when the run began,
  // and the step of the full checkpoint that replaces them once on disk (-1: none written yet).
  bool shards_left_ = false;
  int64_t replacing_step_ = -1;
  // Whether every rank sees rank 0's output folder (out_dir_shared()), once asked.
  std::optional<bool> shared_out_;
  // Last, so that it is destroyed first: a write in progress ends while the folder is locked.
  std::unique_ptr<AsyncCheckpointer> writer_;
};

}  // namespace scaletrain
