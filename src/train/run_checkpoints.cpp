// The trainer's checkpoints (trainer.h, Run in run.h): a resume from a file or from shards,
// what its options change against the checkpoint's, and the save of each checkpoint.

#include "scaletrain/log.h"
#include "scaletrain/trainer.h"

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

#include "checkpoint/checkpoint_dcp.h"
#include "dist/text.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"
#include "scaletrain/flops.h"
#include "scaletrain/rng.h"
#include "scaletrain/sampler.h"
#include "train/report.h"
#include "train/run.h"
#include "train/run_folder.h"
#include "train/strategy.h"
#include "train/validation.h"

namespace scaletrain {

namespace {
// The tensor-parallel degree the generators were saved at: a group's ranks share one stream.
const char* kStreamsKey = "trainer/tensor_parallel";
}  // namespace

void Run::resume() {
  // Every rank planned before the strategy's first collective, so no rank has written yet.
  if (!start_.resume_from && !start_.resume_sharded) {
    state_.run_id = agreed_run_id(start_.run_id);
  } else {
    std::string from;
    if (start_.resume_sharded) {  // every rank reads the shards it needs, at any world size
      const int tp = std::max(o_.tensor_parallel.size, 1);
      const int saved = start_.resume_sharded_tp;
      state_ = strategy_->state().load_sharded(o_.out_dir, *start_.resume_sharded, *opt_, saved);
      if (saved == tp) state_.optimizer_restored = true;
      from = "the sharded checkpoint of step " + std::to_string(*start_.resume_sharded) + " in " +
             o_.out_dir +
             (saved == tp ? ""
                          : " (saved at TrainerOptions::tensor_parallel.size " +
                                std::to_string(saved) + ")");
    } else {
      from = *start_.resume_from;
      state_ = load_checkpoint(from, *model_.module, strategy_->state().optimizer_to_load(*opt_),
                               model_.name);
      strategy_->state().weights_loaded();
    }
    report_differences(state_);
    if (state_.values.erase("scaletrain/sampler_position_per_rank") > 0) {
      state_.sampler.position *= strategy_->data_replicas();  // an older file: exact at its world
    }
    sampler_->load_state(state_.sampler);
    const bool restored =
        strategy_->state().restore_optimizer(*opt_, state_) || state_.optimizer_restored;
    if (auto* scaler = strategy_->state().scaler()) {
      std::map<std::string, at::Tensor> scaler_state;  // fp16's loss scale: an exact resume
      for (const auto& [k, t] : state_.tensors) {
        if (k.rfind("scaler/", 0) == 0) scaler_state[k.substr(7)] = t;
      }
      scaler->load_state(scaler_state);
    }
    restore_rank_state();
    if (state_.run_id.empty()) state_.run_id = start_.run_id.empty() ? "resumed" : start_.run_id;
    r_.last_checkpoint = from;
    if (d_.rank() == 0) {
      drop_metrics_after(r_.metrics_path, state_.global_step);
      log_line(LogLevel::kInfo, resumed_line(from, restored));
    }
    // The options' learning rates win over the file's (a resume with a lower --lr is how a
    // diverged run goes on); a scheduler replays its steps from them to this epoch.
    for (size_t i = 0; i < first_lrs_.size(); ++i)
      opt_->param_groups()[i].options().set_lr(first_lrs_[i]);
    if (scheduler_) {
      for (int64_t e = 0; e < state_.epoch; ++e) scheduler_->step();
    }
  }
  state_.model_name = model_.name;
  record_options();
  if (d_.rank() == 0) {
    begin_run(o_, start_, state_.run_id, model_.name);
    shards_left_ =
        o_.checkpoint_format != CheckpointFormat::kSharded && holds_sharded_checkpoints(o_.out_dir);
  }
  reporter_ = std::make_unique<Reporter>(o_, d_.rank() == 0);
}

// The line that says where the run goes on from, and what of the checkpoint it takes.
std::string Run::resumed_line(const std::string& from, bool optimizer_restored) const {
  if (!state_.has_training_state) {  // Note [Foreign DCP folders] in checkpoint_dcp.cpp
    return "started from " + from +
           ", a distributed checkpoint without scaletrain's training state (as Python's "
           "dcp.save writes): its weights " +
           (optimizer_restored ? "and optimizer state go on"
                               : "go on and the optimizer starts afresh (the folder holds no "
                                 "optimizer state under get_state_dict()'s names that this "
                                 "strategy's optimizer takes)") +
           ", from epoch 1, step 0";
  }
  return "resumed from " + from + " (epoch " + std::to_string(state_.epoch + 1) + ", step " +
         std::to_string(state_.step_in_epoch) + " of it)" +
         (optimizer_restored ? ""
                             : "; its optimizer state was saved by another strategy: the weights "
                               "go on, the optimizer starts afresh");
}

// What this run's options say that the resumed one's said otherwise, and which wins: the seed
// fixes the epoch's data order, so the checkpoint's goes on (each sample of the epoch once);
// learning rates and the batch size are the options'.
void Run::report_differences(const TrainingState& saved) {
  std::vector<std::string> notes;
  auto it = saved.values.find("trainer/seed");
  if (it != saved.values.end() && std::stoull(it->second) != o_.seed) {
    notes.push_back("seed " + std::to_string(o_.seed) + " is not the checkpoint's " + it->second +
                    ": the checkpoint's goes on (it fixes the data order; start "
                    "afresh for another seed)");
    seed_ = std::stoull(it->second);
    const bool whole = o_.fault_tolerant.has_value();  // the whole permutation
    SamplerOptions so{task_.train_data.size,
                      whole ? 1 : strategy_->data_replicas(),
                      whole ? 0 : strategy_->data_rank(),
                      true,
                      seed_,
                      false};
    sampler_ = std::make_unique<DistributedSampler>(so);
  }
  it = saved.values.find("trainer/lr");
  if (it != saved.values.end()) {
    std::ostringstream now;
    now << std::setprecision(17);
    for (double lr : first_lrs_) now << (now.tellp() > 0 ? "," : "") << lr;
    if (now.str() != it->second) {
      std::ostringstream shown;
      shown << first_lrs_[0];
      notes.push_back("learning rate " + shown.str() +
                      " differs from the checkpoint's: " + shown.str() + " goes on");
    }
  }
  it = saved.values.find("trainer/batch_size");
  if (it != saved.values.end() && std::stoll(it->second) != o_.batch_size) {
    notes.push_back("batch size " + std::to_string(o_.batch_size) + " is not the checkpoint's " +
                    it->second + ": the epoch goes on from the same sample in batches of " +
                    std::to_string(o_.batch_size));
  }
  if (d_.rank() != 0) return;
  for (const auto& n : notes) log_line(LogLevel::kInfo, "resume: " + n);
}

// Each rank's generators and running loss sums, saved by save() (Note [Rank streams]). At the
// world they were saved at, each rank takes its own generators; at another, every rank starts a
// stream of its own from the step. So it does at the same world with another tensor-parallel
// or context-parallel degree, whose groups share other streams (streams_layout()).
// Regression (ResumeAtAnotherDegreeSplitTheGroupsStreams): ddp on 2 ranks resumed at tp 2 gave
// the two ranks of the tp group their two old streams, so a GPT's dropout drew different masks
// on them and their replicated activations drifted apart.
void Run::restore_rank_state() {
  restore_loss_sums();
  const auto saved = state_.values.find(kStreamsKey);  // absent: tp 1
  const bool same_streams =
      (saved == state_.values.end() ? std::string("1") : saved->second) == streams_layout();
  if (!same_streams || !restore_rng_states(state_.tensors, d_)) {
    torch::manual_seed(rank_seed(seed_ + static_cast<uint64_t>(state_.global_step), stream()));
  }
}

// The epoch's running loss sums (Note [Global losses] in loss_sums.cpp). A file written before
// they were weighted holds each rank's unweighted sums: their mean stands for the steps before
// the checkpoint, each a whole global batch of this run's targets.
void Run::restore_loss_sums() {
  if (state_.step_in_epoch == 0) return;
  auto sums = state_.tensors.find(kEpochLossKey);
  if (sums != state_.tensors.end()) {
    loss_sum_ = restored_loss_sums(sums->second, d_.rank(), d_.size());
    return;
  }
  sums = state_.tensors.find(kUnweightedEpochLossKey);
  if (sums == state_.tensors.end()) return;
  const double per_sample = static_cast<double>(std::max<int64_t>(targets_per_sample_, 1));
  loss_sum_ = restored_unweighted_loss_sums(
      sums->second, d_.rank(), state_.step_in_epoch,
      static_cast<double>(per_replica_ * strategy_->data_replicas()) * per_sample);
}

void Run::save(int64_t epoch, int64_t step_in_epoch) {
  const auto t0 = Clock::now();
  save_now(epoch, step_in_epoch);
  r_.checkpoint_seconds += since(t0);
  ++r_.checkpoints;
}

void Run::save_now(int64_t epoch, int64_t step_in_epoch) {
  const bool sharded = o_.checkpoint_format == CheckpointFormat::kSharded;
  // Note [Checkpoints every rank writes] in own_boxes.h: a synchronous DCP folder of a
  // strategy that gives its boxes. The weights are assembled in every rank's model all the same
  // (what a program's on_epoch sees there, as after any other checkpoint).
  std::optional<DcpState> boxes;
  if (o_.checkpoint_format == CheckpointFormat::kDcp && !writer_ && !o_.fault_tolerant) {
    boxes = strategy_->state().own_boxes(*opt_);
    if (boxes && !out_dir_shared()) boxes.reset();
  }
  if (!sharded) strategy_->state().gather_weights();  // a sharded checkpoint gathers nothing
  if (!(sharded ? strategy_->state().weights_finite() : all_finite(model_.module->parameters()))) {
    diverged("the weights hold NaN or inf", state_.global_step, epoch, r_.final_loss);
  }
  state_.epoch = epoch;
  state_.step_in_epoch = step_in_epoch;
  state_.sampler = sampler_->state();
  state_.tensors.clear();
  // Every rank's generators and loss sums, for rank 0's file (Note [Rank streams]).
  state_.tensors = gather_rng_states(d_, collective_device());
  state_.values[kStreamsKey] = streams_layout();
  strategy_->state().describe_layout(state_);
  auto sums = at::tensor({loss_sum_.sum, loss_sum_.weight}, at::kDouble);
  state_.tensors[kEpochLossKey] = at::stack(d_.all_gather(sums.to(collective_device()))).cpu();
  if (auto* scaler = strategy_->state().scaler()) {
    for (const auto& [k, t] : scaler->state()) state_.tensors["scaler/" + k] = t;
  }
  if (sharded) {
    r_.last_checkpoint =
        strategy_->state().save_sharded(o_.out_dir, state_, *opt_, o_.keep, writer_.get());
    return;
  }
  if (boxes) {
    if (d_.rank() == 0) {
      drop_replaced_shards();
      DcpState training = training_dcp_state(state_);
      for (auto& t : training.tensors) boxes->tensors.push_back(std::move(t));
      for (auto& v : training.values) boxes->values.push_back(std::move(v));
    } else {
      boxes->values.clear();  // rank 0's are written
    }
    r_.last_checkpoint = commit_distributed_dcp_checkpoint(o_.out_dir, state_.global_step,
                                                           state_.run_id, *boxes, o_.keep, d_);
    if (d_.rank() == 0) {
      if (shards_left_) replacing_step_ = state_.global_step;
      drop_replaced_shards();
    }
    return;
  }
  const torch::optim::Optimizer* opt = strategy_->state().saved_optimizer(*opt_, state_);
  const bool dcp = o_.checkpoint_format == CheckpointFormat::kDcp;
  if (d_.rank() == 0) {
    drop_replaced_shards();  // an earlier background write's, once it is on disk
    if (writer_) {           // --async-checkpoint
      writer_->save(o_.out_dir, state_, *model_.module, opt, o_.keep);
    } else {
      save_checkpoint(o_.out_dir, state_, *model_.module, opt, o_.keep,
                      dcp ? CheckpointLayout::kDcp : CheckpointLayout::kFile);
    }
    if (shards_left_) replacing_step_ = state_.global_step;
    if (!writer_) drop_replaced_shards();
  }
  r_.last_checkpoint = dcp ? dcp_checkpoint_path(o_.out_dir, state_.global_step)
                           : checkpoint_path(o_.out_dir, state_.global_step);
}

// Collective, the first time: whether every rank sees the folder rank 0 writes in (hosts without
// a shared file system do not). Where one does not, rank 0 writes every checkpoint, gathered, as
// it always could, and says so once; the ranks writing their own parts would fail.
// Regression (RanksWithoutTheSharedFolderFailedTheSave): each rank writing its part made a job
// on hosts that share no folder fail at its first checkpoint, where it had run before.
bool Run::out_dir_shared() {
  if (shared_out_) return *shared_out_;
  if (d_.size() == 1) return *(shared_out_ = true);
  namespace fs = std::filesystem;
  const fs::path probe = fs::path(o_.out_dir) / (".scaletrain-shared-" + state_.run_id + "-" +
                                                 std::to_string(state_.global_step));
  if (d_.rank() == 0) {
    std::error_code ec;
    fs::create_directories(o_.out_dir, ec);
    std::ofstream(probe).put('1');
  }
  on_every_rank(d_, true, collective_device());  // rank 0's file is there
  shared_out_ = on_every_rank(d_, fs::exists(probe), collective_device());
  if (d_.rank() == 0) {
    std::error_code ec;
    fs::remove(probe, ec);
    if (!*shared_out_) {
      log_line(LogLevel::kInfo,
               "checkpoints: not every rank sees " + o_.out_dir +
                   ", so rank 0 writes each one whole (with a folder every rank sees, each "
                   "rank writes its own part)");
    }
  }
  return *shared_out_;
}

// Note [Format switch] in run_folder.cpp: the shards go once the full checkpoint of
// replacing_step_ is on disk: after a synchronous save, or once the background write is waited
// for (which throws its failure instead, and the shards stay).
void Run::drop_replaced_shards() {
  if (replacing_step_ < 0) return;
  if (writer_) writer_->wait();
  remove_replaced_shards(o_.out_dir, state_.run_id, replacing_step_);
  replacing_step_ = -1;
  shards_left_ = false;
}

}  // namespace scaletrain
