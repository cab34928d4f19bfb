// The trainer's loop (trainer.h), one for every strategy (Note [Strategies] in strategy.cpp):
//
//   setup      the model (the task's), the strategy, the optimizer and scheduler, the sampler
//   resume     a checkpoint's weights, optimizer, scaler and sampler; the scheduler replayed
//   epoch      this rank's slice of the data in batches; a step each; checkpoints on the way
//   evaluate   the task's metrics on the test data, exact over every rank
//   finish     join, model.pt, the result
//
// Note [Divergence]: a non-finite loss must stop the run before it writes anything. Under DDP
// the averaged gradients are the same bits on every rank, so checking them (rather than each
// rank's own loss) makes every rank stop at the same step (a grid agrees over the world); the
// weights are checked again before every checkpoint and before model.pt, so no file ever holds
// NaN or inf weights. fp16 runs leave overflowing steps to the GradScaler, which skips them.
// Where the check is read with a delay (Note [Deferred reads] in run_steps.cpp), the run still
// stops naming the bad step, and every checkpoint reads the pending checks first.

#include "scaletrain/trainer.h"
#include "scaletrain/log.h"

#include <signal.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <set>
#include <sstream>

#include "dist/text.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"
#include "scaletrain/flops.h"
#include "scaletrain/rng.h"
#include "scaletrain/sampler.h"
#include "train/replica_settings.h"
#include "train/report.h"
#include "train/run.h"
#include "train/run_folder.h"
#include "train/strategy.h"
#include "train/validation.h"

namespace scaletrain {

namespace fs = std::filesystem;

// The task with its defaults filled in.
TrainTask completed(TrainTask t) {
  if (!t.model) throw UsageError("TrainTask::model is not set: give a function that builds it");
  if (!t.train_data.batch || t.train_data.size < 1) {
    throw UsageError("TrainTask::train_data is empty: give a data source (trainer.h)");
  }
  if (!t.loss) {
    t.loss = [](const at::Tensor& out, const at::Tensor& y) {
      if (out.dim() == 2 && y.sizes() == out.sizes() && at::isFloatingType(y.scalar_type())) {
        return torch::nn::functional::cross_entropy(out, y);  // class probabilities
      }
      check_class_shapes(out, y, "the default loss (cross entropy)");
      if (out.dim() == 2) return torch::nn::functional::cross_entropy(out, y);
      return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
    };
  }
  if (!t.optimizer) {
    t.optimizer = [](const std::vector<at::Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9));
    };
  }
  if (t.metrics.empty() && t.test_data.size > 0) t.metrics.push_back(accuracy());
  return t;
}

// Regression (TimeBalanceChangedOnResume): a grid with --balance auto or time measures its
// split at the start; a resume that measured another split (under other load) gave its stages
// other parameters, and their optimizer state was dropped. A resume keeps the checkpoint's
// split when it is of the same pipeline; a list given on the command line still wins.
void Run::keep_checkpoint_balance() {
  const auto p = o_.pipeline.resolved();
  if (!start_.resume_from || o_.strategy != Strategy::kGrid || p.balance.by != Balance::By::kTime) {
    return;
  }
  const auto layout = checkpoint_value(*start_.resume_from, "grid/stages");
  const std::string same =
      std::to_string(p.stages) +
      (p.stages_per_device == 1 ? "" : "x" + std::to_string(p.stages_per_device)) + ":";
  if (layout && layout->rfind(same, 0) == 0) {
    o_.pipeline.balance = Balance::parse(layout->substr(same.size()));
  }
}

void Run::setup() {
  require_joined(d_, "train()");
  validate(o_, d_.size());
  // Rank 0 owns the folder for the run (Note [Folder owner] in run_folder.cpp); a second run
  // is refused here, naming this one.
  if (d_.rank() == 0) folder_lock_ = std::make_unique<FolderLock>(o_.out_dir);
  if (o_.async_checkpoint) {
    AsyncCheckpointOptions ao;
    if (o_.checkpoint_format == CheckpointFormat::kDcp) ao.layout = CheckpointLayout::kDcp;
    writer_ = std::make_unique<AsyncCheckpointer>(ao);
  }
  start_ = plan_run_start(o_);
  keep_checkpoint_balance();
  seed_ = o_.seed;
  torch::manual_seed(o_.seed);
  model_ = task_.model();
  if (!model_.module || !model_.forward) {
    throw UsageError("TrainTask::model built no module or no forward (use model_of in trainer.h)");
  }
  if (o_.channels_last) to_channels_last(*model_.module);
  const int64_t n = std::min<int64_t>(task_.train_data.size, 8);
  std::vector<int64_t> first(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) first[static_cast<size_t>(i)] = i;
  const Batch sample = task_.train_data.batch(first, 0);
  check_model_takes(sample);
  targets_per_sample_ = sample.targets.dim() > 1 ? sample.targets[0].numel() : 0;
  if (o_.tensor_parallel.size > 1 && model_.output_split && !default_loss_) {
    throw UsageError("tensor parallelism: model '" + model_.name +
                     "' gives outputs split over the tensor-parallel group, which TrainTask::loss "
                     "cannot take; leave it unset (the model's parallel_loss is used)");
  }
  strategy_ = make_strategy(task_, o_, d_, model_, sample.inputs);
  opt_ = task_.optimizer(strategy_->parameters());
  for (auto& g : opt_->param_groups()) first_lrs_.push_back(g.options().get_lr());
  if (task_.scheduler) {
    // PyTorch counts a scheduler's construction as its step 0 (and decays StepLR after
    // step_size epochs); LibTorch's count starts at the first step(): take that step here.
    scheduler_ = task_.scheduler(*opt_);
    scheduler_->step();
  }
  // The weights came from one seed on every rank (rank 0's win); from here each rank draws its
  // own stream (Note [Rank streams] in rng.cpp).
  torch::manual_seed(rank_seed(o_.seed, stream()));
  SamplerOptions so;
  so.dataset_size = task_.train_data.size;
  so.num_replicas = strategy_->data_replicas();
  so.rank = strategy_->data_rank();
  if (o_.fault_tolerant) {  // the whole permutation: each step splits it over the live replicas
    so.num_replicas = 1;
    so.rank = 0;
    if (scheduler_) {
      throw UsageError(
          "fault-tolerant replicas: a learning-rate schedule is not supported yet "
          "(a healed replica would replay another one); leave TrainTask::scheduler "
          "unset (--lr-schedule none)");
    }
    ReplicaGroupOptions ro = *o_.fault_tolerant;
    // Note [Replica settings]: a program's own settings first, then everything that changes
    // the arithmetic.
    const std::string mine =
        replica_settings(o_, model_.name, *model_.module, *opt_, task_.train_data.size);
    ro.fingerprint = ro.fingerprint.empty() ? mine : ro.fingerprint + "|" + mine;
    replicas_ = std::make_unique<ReplicaGroup>(d_, ro);
  }
  so.seed = seed_;
  sampler_ = std::make_unique<DistributedSampler>(so);
  per_replica_ = o_.batch_size / strategy_->data_replicas();
  setup_device_side();
  state_.model_name = model_.name;
  r_.metrics_path = o_.out_dir + "/metrics.jsonl";
}

// Note [Model against data]: one sample through the model on the CPU before any work, and its
// output against the default loss's shapes, so that a model built for other inputs (LeNet on
// 32x32 images, an MLP of another width, a toy model on images) fails here with both shapes
// named, instead of inside the first step in LibTorch's words with a backtrace.
void Run::check_model_takes(const Batch& sample) {
  torch::NoGradGuard no_grad;
  const bool training = model_.module->is_training();
  model_.module->eval();
  const at::Tensor x = sample.inputs.slice(0, 0, 1), y = sample.targets.slice(0, 0, 1);
  at::Tensor out;
  try {
    out = model_.forward(x);
  } catch (const c10::Error& e) {
    model_.module->train(training);
    std::string why = e.what_without_backtrace();
    why = why.substr(0, why.find('\n'));
    throw UsageError("the model '" + model_.name + "' cannot take the data's samples (a batch of " +
                     "one is " + c10::str(x.sizes()) + ", " + c10::toString(x.scalar_type()) +
                     "): " + why +
                     ". Build the model for the data's shape (scaletrain train: choose --model "
                     "for --dataset and --image-size)");
  }
  model_.module->train(training);
  const bool probabilities = at::isFloatingType(y.scalar_type()) && y.sizes() == out.sizes();
  if (default_loss_ && !probabilities) {
    check_class_shapes(out, y, "the default loss (cross entropy)");
  }
}

// The options a resume compares against (report_differences()).
void Run::record_options() {
  std::ostringstream lrs;
  lrs << std::setprecision(17);
  for (double lr : first_lrs_) lrs << (lrs.tellp() > 0 ? "," : "") << lr;
  state_.values["trainer/seed"] = std::to_string(seed_);
  state_.values["trainer/lr"] = lrs.str();
  state_.values["trainer/batch_size"] = std::to_string(o_.batch_size);
}

// A fresh run's id, rank 0's on every rank: each rank planned its own, and the ranks of a
// sharded checkpoint must write one id (a shard of another run is not loaded with the rest).
std::string Run::agreed_run_id(const std::string& mine) {
  return dist_text::broadcast_text(d_, mine, "the run id");
}

at::Device Run::collective_device() const {
  return d_.backend_name == "nccl" ? strategy_->device() : at::Device(at::kCPU);
}

LoaderOptions Run::loader_options(int64_t batch, uint64_t seed, int64_t first_batch) const {
  LoaderOptions lo;
  lo.batch_size = batch;
  lo.workers = o_.workers;
  lo.prefetch = 2;
  lo.pin_memory = strategy_->device().is_cuda();
  lo.seed = seed;
  lo.first_batch = first_batch;
  return lo;
}

void Run::epoch(int64_t e) {
  if (e != sampler_->epoch()) {
    sampler_->set_epoch(e);
    loss_sum_ = {};
  }
  // The batches already trained in this epoch, by every replica (Note [Global position] in
  // sampler.cpp: the same count at any world size), and those left to this rank.
  const int64_t global_batch = per_replica_ * strategy_->data_replicas();
  int64_t done = sampler_->state().position / global_batch;
  const std::vector<int64_t> remaining = sampler_->remaining();
  const int64_t batches =
      done + (static_cast<int64_t>(remaining.size()) + per_replica_ - 1) / per_replica_;
  global_reads_ = same_batches_everywhere(e, batches);
  // Augmentation differs per epoch and data replica; a resumed epoch sees the same batches.
  const uint64_t seed = (seed_ * 1000003 + static_cast<uint64_t>(e)) * 1009 +
                        static_cast<uint64_t>(strategy_->data_rank());
  auto next = batch_stream(task_.train_data, train_rows_, remaining,
                           loader_options(per_replica_, seed, done));
  const auto t0 = Clock::now();
  double loss = std::numeric_limits<double>::quiet_NaN();
  while (auto b = next()) {
    const bool last_micro = (done + 1) % o_.accumulate == 0 || done + 1 == batches;
    Pending p = step(*b, last_micro, e);
    sampler_->advance(b->targets.size(0));
    ++done;
    ++state_.global_step;
    samples_ += b->targets.size(0) * strategy_->data_replicas();
    p.done = done, p.global_step = state_.global_step, p.lr = lr(), p.seconds = since(t0);
    pending_.push_back(std::move(p));
    const bool checkpoint =
        o_.checkpoint_every > 0 && state_.global_step % o_.checkpoint_every == 0 && last_micro;
    if (settle_due(done, batches, checkpoint)) loss = settle(e, batches);
    StepReport report{e + 1, done, state_.global_step, loss, false, grad_norm_};
    if (checkpoint) {
      save(e, done);
      report.checkpointed = true;
    }
    if (task_.on_step) task_.on_step(report);
  }
  // A rank whose batches ran out says so before anything else collective (Note [Uneven
  // inputs] in ddp.h): with "fail" every rank stops here or in its next step.
  strategy_->end_epoch();
  if (!pending_.empty()) settle(e, batches);
  end_epoch(e, since(t0));
}

// Whether every rank has this epoch's `batches` (collective). They have unless the ranks were
// given other data or batch sizes: under UnevenInputs::kJoin the ranks then read their steps'
// losses on their own (they meet in no collective before the epoch's end, Note [Global
// losses]); otherwise the run stops here, before a step, naming the ranks' counts.
bool Run::same_batches_everywhere(int64_t e, int64_t batches) {
  const auto all = d_.all_gather(at::tensor({batches}, at::kLong).to(collective_device()));
  std::string counts;
  bool same = true;
  for (size_t r = 0; r < all.size(); ++r) {
    const int64_t theirs = all[r].item<int64_t>();
    same = same && theirs == batches;
    counts += (r ? ", rank " : "rank ") + std::to_string(r) + " " + std::to_string(theirs);
  }
  if (same || o_.ddp.uneven_inputs == UnevenInputs::kJoin) return same;
  throw Error("rank " + std::to_string(d_.rank()) + ": uneven inputs in epoch " +
              std::to_string(e + 1) + ": the ranks have different numbers of batches (" + counts +
              "); give every rank the same data and TrainerOptions::batch_size, or "
              "TrainerOptions::ddp.uneven_inputs join under ddp");
}

// This rank's random stream: its own, but one per tensor-parallel group and context-parallel
// group, whose ranks draw the same dropout masks (Note [Coordinated dropout] in zoo/gpt.cpp; the
// meshes are {dp, cp, pp, tp} in that order, so a tp group is consecutive ranks and a cp group's
// ranks lie pp · tp apart). Under fault tolerance rank k of every replica is rank k of its own
// world: the replica's id keeps their streams apart.
int Run::stream() const {
  if (o_.fault_tolerant) return (o_.fault_tolerant->replica_id + 1) * 100000 + d_.rank();
  const int tp = std::max(o_.tensor_parallel.size, 1);
  const ParallelDims dims = parallel_dims(o_).resolve(d_.size());
  const int q = d_.rank() / tp;  // the (dp, cp, pp) coordinates: the cp one left out
  return q / (dims.cp * dims.pp) * dims.pp + q % dims.pp;
}

// What stream() groups by: "T" (the tp degree, as checkpoints before cp wrote it), with
// " cp C pp P" where a cp group shares a stream.
std::string Run::streams_layout() const {
  const ParallelDims dims = parallel_dims(o_).resolve(d_.size());
  const std::string tp = std::to_string(std::max(o_.tensor_parallel.size, 1));
  if (o_.fault_tolerant || dims.cp == 1) return tp;
  return tp + " cp " + std::to_string(dims.cp) + " pp " + std::to_string(dims.pp);
}

void Run::end_epoch(int64_t e, double seconds) {
  EpochReport report;
  report.seconds = seconds;
  train_seconds_ += report.seconds;
  // The epoch's loss over every replica's batches, a resumed epoch's before the resume too,
  // each weighted by its targets (Note [Global losses] in loss_sums.cpp).
  const auto sums = over_world({loss_sum_.sum, loss_sum_.weight});
  report.loss = sums[1] > 0 ? sums[0] / sums[1] : 0;
  report.metrics = evaluate();
  if (scheduler_) scheduler_->step();
  sampler_->set_epoch(e + 1);
  loss_sum_ = {};
  save(e + 1, 0);
  report.epoch = e + 1;
  report.global_step = state_.global_step;
  reporter_->epoch(report);
  r_.epoch_seconds.push_back(report.seconds);
  r_.final_loss = report.loss;
  r_.metrics = report.metrics;
  if (task_.on_epoch) task_.on_epoch(report);
}

void Run::diverged(const std::string& what, int64_t step, int64_t epoch, double loss) {
  std::ostringstream s;
  s << "rank " << d_.rank() << ": training diverged at step " << step << " (epoch " << epoch + 1
    << "): " << what << " (the loss was " << loss << "). Nothing was written after that; ";
  if (r_.last_checkpoint.empty()) {
    s << "no checkpoint of this run was written yet. ";
  } else {
    s << "the last checkpoint, written before, is " << r_.last_checkpoint
      << " (resume from it with a lower learning rate). ";
  }
  s << "Lower the learning rate (now " << lr() << ")"
    << (o_.amp == Amp::kFp16 ? "" : ", or check the data for inf/NaN values") << ".";
  throw Error(s.str());
}

// The peak that MFU is measured against (TrainResult::peak_flops): the options' per device, or
// on the CPU the fp32 matmul rate that every rank measures at once after a barrier (ranks that
// share cores measure their share), averaged over the ranks. Nothing is measured for a model
// that states no FLOPs, and nothing is guessed on CUDA.
void Run::settle_peak() {
  if (model_.flops_per_sample <= 0) return;
  if (o_.peak_flops > 0) {
    r_.peak_flops = o_.peak_flops;
    return;
  }
  for (const auto& dev : strategy_->devices()) {
    if (at::Device(dev.device).type() != at::kCPU) return;
  }
  d_.barrier("the matmul peak");
  auto peak = at::tensor({measure_cpu_matmul_peak()}, at::kDouble).to(collective_device());
  d_.all_reduce(peak);
  r_.peak_flops = peak.item<double>() / d_.size();
  r_.peak_measured = true;
}

void Run::finish() {
  if (writer_) writer_->wait();  // the last checkpoint is on disk (or its failure thrown)
  if (d_.rank() == 0) drop_replaced_shards();
  // Every rank's shards are on disk before rank 0 clears the folder (Note [Folder cleanup]).
  const bool shards = o_.checkpoint_format == CheckpointFormat::kSharded;
  if (shards && d_.size() > 1) d_.barrier("the last shards' writes");
  strategy_->end_epoch();
  strategy_->state().gather_weights();
  if (!all_finite(model_.module->parameters())) {
    diverged("the weights hold NaN or inf", state_.global_step, o_.epochs - 1, r_.final_loss);
  }
  if (d_.rank() == 0) {
    r_.weights_path = o_.out_dir + "/model.pt";
    save_weights(r_.weights_path, *model_.module);
    remove_dead_temporaries(o_.out_dir);  // Note [Folder cleanup]
  }
  r_.devices = strategy_->devices();
  r_.device = r_.devices.empty() ? "" : r_.devices[0].device;
  r_.peak_memory_bytes = r_.devices.empty() ? 0 : r_.devices[0].peak_memory_bytes;
  r_.global_step = state_.global_step;
  r_.samples_per_second = train_seconds_ > 0 ? static_cast<double>(samples_) / train_seconds_ : 0;
  r_.tokens_per_second = r_.samples_per_second * static_cast<double>(targets_per_sample_);
  r_.model_flops_per_second =
      r_.samples_per_second * static_cast<double>(std::max<int64_t>(model_.flops_per_sample, 0));
  std::set<std::string> distinct;  // dp on "cpu,cpu": one CPU
  for (const auto& dev : r_.devices) distinct.insert(dev.device);
  r_.mfu = model_flops_utilization(r_.model_flops_per_second, r_.peak_flops,
                                   static_cast<int64_t>(d_.size()) *
                                       std::max<int64_t>(static_cast<int64_t>(distinct.size()), 1));
  auto acc = r_.metrics.find("test_accuracy");
  r_.test_accuracy = acc == r_.metrics.end() ? 0 : acc->second;
}

TrainResult Run::go() {
  setup();
  resume();
  settle_peak();
  if (replicas_) {
    train_fault_tolerant();
    if (left_behind_) {  // nothing of this replica's is the run's: no model.pt
      r_.global_step = state_.global_step;
      r_.left_behind = true;
      return r_;
    }
  } else {
    for (int64_t e = state_.epoch; e < o_.epochs; ++e) epoch(e);
  }
  if (r_.epoch_seconds.empty()) {
    // Resumed from a checkpoint of a finished run: nothing to train, report where it stands.
    r_.metrics = evaluate();
    if (d_.rank() == 0) {
      log_line(LogLevel::kInfo, "all " + std::to_string(o_.epochs) +
                                    " epochs were already trained in " + o_.out_dir +
                                    "; give more TrainerOptions::epochs to continue, or "
                                    "TrainerOptions::resume none to start again");
    }
  }
  finish();
  return r_;
}

void validate_tensor_parallel(const TrainerOptions& o, int world);   // tp_apply.cpp
void validate_context_parallel(const TrainerOptions& o, int world);  // tp_apply.cpp
void validate_expert_parallel(const TrainerOptions& o, int world);   // tp_apply.cpp

void validate(const TrainerOptions& o, int world) {
  validate_trainer_numbers(o);
  validate_tensor_parallel(o, world);
  validate_context_parallel(o, world);
  validate_expert_parallel(o, world);
  validate_strategy(o, world);
  validate_output(o);
}

void require_free_output_folder(const TrainerOptions& o) {
  if (auto holder = FolderLock::holder(o.out_dir)) {  // Note [Folder owner]
    throw UsageError("the output folder '" + o.out_dir + "' is in use by a live run (" + *holder +
                     "): wait for it to end, stop it, or choose another TrainerOptions::out_dir");
  }
}

TrainResult train(const TrainTask& task, const TrainerOptions& options, const Dist& dist) {
  return Run(task, options, dist).go();
}

}  // namespace scaletrain
