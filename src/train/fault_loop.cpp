// The trainer's loop for fault-tolerant replicas (TrainerOptions::fault_tolerant).
//
// Note [Fault-tolerant loop]: each step asks for the quorum of the live replicas
// (ReplicaGroup::quorum, Note [Replica groups] in src/dist/fault_tolerance.cpp); where one is
// behind, the donor's state (the same bytes as a checkpoint's payload: weights, buffers,
// optimizer, epoch, step and the sampler's global position, and the epoch's loss sums) reaches
// it first. Then the step's batch: the epoch's one permutation (the sampler over one replica),
// from its global position, batch_size per live replica, split in order over (replica's place
// in the quorum, rank in the replica). The replica's own DDP averages its ranks' gradients, the
// replicas sum theirs and divide by their number, and the step is committed, the optimizer
// stepped and the position moved, only when every exchange succeeded; otherwise the same
// position is tried again at the next quorum. So every sample of an epoch is trained once
// whatever the replicas did (the tail shorter than a sample per rank is left, as drop_last
// would), and the loss curve is that of a run whose batch shrank while replicas were gone.

#include <torch/nn/module.h>

#include <cmath>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>

#include "checkpoint/checkpoint_io.h"
#include "scaletrain/error.h"
#include "scaletrain/log.h"
#include "train/run.h"

namespace scaletrain {

void Run::train_fault_tolerant() {
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  auto t0 = Clock::now();
  const int64_t n = task_.train_data.size;
  while (state_.epoch < o_.epochs) {
    const Quorum q = replicas_->quorum(state_.global_step);
    if (q.finished_at >= 0) {
      left_behind_ = true;
      if (d_.rank() == 0) {
        log_line(LogLevel::kInfo,
                 "replica " + std::to_string(o_.fault_tolerant->replica_id) +
                     ": the other replicas finished the run at step " +
                     std::to_string(q.finished_at) + " while this one was at step " +
                     std::to_string(state_.global_step) +
                     "; nothing is left to train here (their folders hold the final weights)");
      }
      return;
    }
    if (q.heal) {
      // Every member's module holds its whole weights for the transfer (ZeRO-3 gathers its
      // shards; collective within each replica, whose ranks all know q).
      strategy_->state().gather_weights();
      at::Tensor got;
      if (!replicas_->share_state([this] { return replica_state(); }, &got)) {
        replicas_->commit(false);
        continue;
      }
      if (q.recovering) load_replica_state(got);
    }
    if (order_epoch != state_.epoch) {
      order = sampler_->permutation();
      order_epoch = state_.epoch;
      t0 = Clock::now();
    }
    const int64_t e = state_.epoch, at = sampler_->state().position;
    const int64_t ranks = static_cast<int64_t>(q.size()) * d_.size();
    const int64_t take = std::min(ranks * per_replica_, n - at);
    if (take >= ranks) {
      const int64_t j = static_cast<int64_t>(q.slot) * d_.size() + d_.rank();
      const auto first = order.begin() + at + take * j / ranks;
      const auto last = order.begin() + at + take * (j + 1) / ranks;
      const uint64_t seed = (seed_ * 1000003 + static_cast<uint64_t>(e)) * 1009 +
                            static_cast<uint64_t>(state_.global_step);
      const Batch b = task_.train_data.batch(std::vector<int64_t>(first, last), seed);
      double loss = 0;
      if (!replica_step(b, q, &loss)) continue;  // not committed: this position again
      sampler_->advance(take);
      ++state_.step_in_epoch;
      ++state_.global_step;
      samples_ += take;
      if (std::isfinite(loss) && strategy_->counts_loss()) {  // Note [Global losses]
        loss_sum_.add(loss, strategy_->loss_weight_of(b.targets).item<double>());
      }
      const int64_t left = n - sampler_->state().position;
      reporter_->step(
          e, state_.step_in_epoch,
          state_.step_in_epoch + (left + ranks * per_replica_ - 1) / (ranks * per_replica_),
          state_.global_step, loss, loss_sum_.weight > 0 ? loss_sum_.mean() : loss, lr(),
          since(t0));
      StepReport report{e + 1, state_.step_in_epoch, state_.global_step, loss, false, grad_norm_};
      if (o_.checkpoint_every > 0 && state_.global_step % o_.checkpoint_every == 0) {
        save(e, state_.step_in_epoch);
        report.checkpointed = true;
      }
      if (task_.on_step) task_.on_step(report);
    } else {
      sampler_->advance(n - at);  // fewer samples than ranks: the tail is left (drop_last)
    }
    if (sampler_->state().position >= n) {
      // The run's last step: a replica behind from here has no peer left to heal it.
      if (e + 1 == o_.epochs) replicas_->finished(state_.global_step);
      end_epoch(e, since(t0));
      state_.step_in_epoch = 0;
    }
  }
}

// One step of this replica's batch: the replica's DDP, then the sum over the replicas; the
// optimizer steps only when the replica commits (every exchange of every rank succeeded).
bool Run::replica_step(const Batch& b, const Quorum& q, double* loss) {
  const at::Device dev = strategy_->device();
  const at::Tensor l = strategy_->step(b.inputs.to(dev, true), b.targets.to(dev, true), true, 1.0);
  *loss = l.defined() ? l.item<double>() : std::numeric_limits<double>::quiet_NaN();
  std::vector<at::Tensor> grads;
  for (auto& p : strategy_->parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  bool ok = true;
  if (q.size() > 1 && !grads.empty()) {
    at::Tensor flat = flat_copy(grads, dev);
    ok = replicas_->all_reduce(flat);
    if (ok) copy_from_flat(flat.div_(q.size()), grads);
  }
  if (!replicas_->commit(ok)) {
    strategy_->zero_grad(*opt_);
    return false;
  }
  if (!strategy_->gradients_finite()) {
    diverged("the gradients hold NaN or inf", state_.global_step + 1, state_.epoch, *loss);
  }
  if (o_.max_grad_norm > 0) grad_norm_ = strategy_->clip_gradients(o_.max_grad_norm);
  strategy_->optimizer_step(*opt_);
  strategy_->zero_grad(*opt_);
  return true;
}

// What a replica behind takes from the donor: a checkpoint's payload, in memory.
at::Tensor Run::replica_state() {
  TrainingState s = state_;
  s.sampler = sampler_->state();
  s.tensors.clear();
  std::ostringstream sum, weight;
  sum << std::hexfloat << loss_sum_.sum;
  weight << std::hexfloat << loss_sum_.weight;
  s.values["replica/loss_sum"] = sum.str();
  s.values["replica/loss_weight"] = weight.str();
  const std::string payload = checkpoint_payload(s, named_parameters_of(*model_.module),
                                                 named_buffers_of(*model_.module), opt_.get());
  auto out = at::empty({static_cast<int64_t>(payload.size())}, at::kByte);
  std::memcpy(out.data_ptr(), payload.data(), payload.size());
  return out;
}

void Run::load_replica_state(const at::Tensor& bytes) {
  const std::string payload(static_cast<const char*>(bytes.data_ptr()),
                            static_cast<size_t>(bytes.numel()));
  const std::string run_id = state_.run_id;
  state_ = load_checkpoint_payload(payload, "the donor replica's state", *model_.module, opt_.get(),
                                   model_.name);
  state_.run_id = run_id;
  strategy_->state().weights_loaded();
  sampler_->load_state(state_.sampler);
  loss_sum_.sum = std::strtod(state_.values["replica/loss_sum"].c_str(), nullptr);
  loss_sum_.weight = std::strtod(state_.values["replica/loss_weight"].c_str(), nullptr);
  state_.values.erase("replica/loss_sum");
  state_.values.erase("replica/loss_weight");
  record_options();
}

}  // namespace scaletrain
