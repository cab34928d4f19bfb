// The trainer's step and what it reads back (Note [Deferred reads]), what lives on the strategy's
// device (the backend that carries it, the rows of data_on_device), and where its batches come
// from (Note [Data on the device]). The loop around them is in trainer.cpp.

#include <ATen/ops/index_select.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/error.h"
#include "train/run.h"

namespace scaletrain {

// Note [Deferred reads]: on a GPU the host queues kernels ahead of the device, and every value
// it reads back (a loss, a finite-gradients verdict) makes it wait for the device to drain, so
// the device then idles while the host queues the next step. Where the strategy can say whether
// the gradients are finite with a flag on the device (gradients_finite_flag(): ddp, without
// fp16), the trainer reads the steps' losses and flags in a batch: at log points, at the running
// mean's points, before a checkpoint, at the epoch's end, and at the latest every kDeferredSteps
// steps, in the steps' order, as the loop would have read them one by one. A step whose gradients
// were not finite is still named by its number; the steps queued after it ran on NaN weights and
// are dropped with the run, and every rank stops at the same reading. The other strategies check
// the gradients in the step, as before (a collective verdict for the sharded, pipelined and
// tensor-parallel ones, the scaler's for fp16), and only their losses are read later. Still read
// every step: the norm for --max-grad-norm, fp16's scaler, and every step when a TrainTask
// has an on_step hook on any rank (the ranks agree on one choice at setup). On the CPU nothing
// waits either way; the trainer defers there too, so that every test runs the one path.
constexpr size_t kDeferredSteps = 32;

// The steps at which the progress line (without a terminal) shows the running mean: a quarter
// of the epoch.
static bool mean_reported_at(int64_t done, int64_t batches) {
  return done == batches || done % std::max<int64_t>(1, batches / 4) == 0;
}

// Whether the pending steps are read after the epoch's `done`-th step. Every rank reads at the
// same steps, as the reading is collective (Note [Global losses] in loss_sums.cpp: the steps'
// losses summed over the world), so that the collectives meet in the same order with the steps'
// own, whichever rank defers.
bool Run::settle_due(int64_t done, int64_t batches, bool checkpoint) const {
  const int64_t step = state_.global_step;
  return !defer_reads_ || checkpoint || pending_.size() >= kDeferredSteps ||
         mean_reported_at(done, batches) || (o_.log_every > 0 && step % o_.log_every == 0);
}

Run::Pending Run::step(const Batch& b, bool last_micro, int64_t epoch) {
  const at::Device dev = strategy_->device();
  auto x = b.inputs.to(dev, true);
  if (o_.channels_last && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  auto y = b.targets.to(dev, true);
  const double weight = o_.accumulate > 1 ? 1.0 / o_.accumulate : 1.0;
  Pending p;
  p.loss = strategy_->step(x, y, last_micro, weight);
  if (p.loss.defined() && strategy_->counts_loss()) p.weight = strategy_->loss_weight_of(y);
  if (last_micro) {
    if (defer_reads_) p.finite = strategy_->gradients_finite_flag();
    if (!p.finite.defined() && !strategy_->gradients_finite()) {
      const double value =
          p.loss.defined() ? p.loss.item<double>() : std::numeric_limits<double>::quiet_NaN();
      diverged("the gradients hold NaN or inf", state_.global_step + 1, epoch, value);
    }
    if (o_.max_grad_norm > 0) grad_norm_ = strategy_->clip_gradients(o_.max_grad_norm);
    strategy_->optimizer_step(*opt_);
    strategy_->zero_grad(*opt_);
  }
  return p;
}

// Reads the pending steps' results in their order (Note [Deferred reads]): the divergence check,
// the epoch's loss sums, the metric lines and progress, each step's loss the global batch's
// (Note [Global losses]: one all-reduce of every pending step's sums and the epoch's so far).
// Every rank gets the same figures, a rank that computes no loss too (a grid's first stages,
// rank 0 among them: Regression (GridProgressLineShowedNaN), its progress line said "loss nan").
// Returns the last step's loss.
double Run::settle(int64_t e, int64_t batches) {
  const size_t n = pending_.size();
  std::vector<double> mine(2 * n + 2), values(n);
  for (size_t i = 0; i < n; ++i) {
    const Pending& p = pending_[i];
    values[i] = p.loss.defined() ? p.loss.item<double>() : std::numeric_limits<double>::quiet_NaN();
    const double w = p.weight.defined() ? p.weight.item<double>() : 0;
    mine[2 * i] = w > 0 ? values[i] * w : 0;
    mine[2 * i + 1] = w;
  }
  mine[2 * n] = loss_sum_.sum, mine[2 * n + 1] = loss_sum_.weight;
  const std::vector<double> all = global_reads_ ? over_world(mine) : mine;
  LossSum running{all[2 * n], all[2 * n + 1]};
  double value = std::numeric_limits<double>::quiet_NaN();
  for (size_t i = 0; i < n; ++i) {
    const Pending& p = pending_[i];
    if (p.finite.defined() && !p.finite.item<bool>()) {
      diverged("the gradients hold NaN or inf", p.global_step, e, values[i]);
    }
    const LossSum step{all[2 * i], all[2 * i + 1]};
    value = step.mean();
    if (std::isfinite(value)) {  // an overflowing fp16 step, skipped, counts for nothing
      running.sum += step.sum, running.weight += step.weight;
      loss_sum_.sum += mine[2 * i], loss_sum_.weight += mine[2 * i + 1];
    }
    reporter_->step(e, p.done, batches, p.global_step, value, running.mean(), p.lr, p.seconds);
  }
  pending_.clear();
  return value;
}

// `mine` summed over the world, in float64, through the collectives' device.
std::vector<double> Run::over_world(const std::vector<double>& mine) {
  auto t = at::tensor(mine, at::kDouble).to(collective_device());
  d_.all_reduce(t);
  t = t.cpu();
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

// What lives on the strategy's device: the collectives' backend must carry it, the rows of
// data_on_device go there, and the ranks agree whether to read the steps' results late.
void Run::setup_device_side() {
  if (d_.backend_name == "nccl" && strategy_->device().is_cpu()) {  // train_backend() in zoo.cpp
    throw UsageError("rank " + std::to_string(d_.rank()) +
                     ": the process group is NCCL, which carries CUDA tensors only, and this "
                     "run's collectives are on the CPU (" +
                     to_string(o_.strategy) +
                     " on cpu); join it with Gloo (InitOptions::backend = \"gloo\"; scaletrain "
                     "train picks Gloo by itself)");
  }
  if (o_.data_on_device && o_.fault_tolerant) {
    throw UsageError(
        "TrainerOptions::data_on_device is not for fault-tolerant replicas, "
        "whose batches follow the quorum; leave it out with TrainerOptions::fault_tolerant");
  }
  if (o_.data_on_device) {
    train_rows_ = rows_on_device(task_.train_data, "train");
    test_rows_ = rows_on_device(task_.test_data, "test");
  }
  // Note [Deferred reads]: one choice for every rank, so that under ddp all stop at a bad step
  // together (an on_step hook on one rank makes every rank read each step).
  defer_reads_ = on_every_rank(d_, !task_.on_step, collective_device());
}

// Note [Data on the device]: with data_on_device an in-memory split's rows are copied to the
// device once, and a batch is an index_select there of the rows the loader would have gathered
// on the CPU (the same indices, in the same order): no loader thread, no pinned buffer, no copy
// per step, and the same batches, so a run and its resume do not depend on where the rows live.
Dataset Run::rows_on_device(const DataSource& source, const char* split) const {
  if (source.size == 0) return {};
  if (!source.rows) {
    throw UsageError(std::string("TrainerOptions::data_on_device keeps ") +
                     "in-memory data sets on the device, but the " + split +
                     " split is not one (its DataSource has no rows: build it with in_memory(); "
                     "scaletrain train: --dataset fashion-mnist or synthetic)");
  }
  Dataset d = *source.rows;
  const at::Device dev = strategy_->device();
  d.inputs = d.inputs.to(dev);
  d.targets = d.targets.to(dev);
  return d;
}

Run::Batches Run::batch_stream(const DataSource& source, const Dataset& rows,
                               std::vector<int64_t> indices, const LoaderOptions& lo) const {
  if (!rows.inputs.defined()) {
    auto loader = std::make_shared<Loader>(source.batch, std::move(indices), lo);
    return [loader] { return loader->next(); };
  }
  auto order = at::tensor(indices, at::kLong).to(rows.inputs.device());
  auto next = std::make_shared<int64_t>(0);
  return [rows, order, next, lo]() -> std::optional<Batch> {
    const int64_t start = *next * lo.batch_size, n = order.size(0);
    if (start >= n || (lo.drop_last && start + lo.batch_size > n)) return std::nullopt;
    const auto part = order.slice(0, start, std::min(start + lo.batch_size, n));
    Batch b{rows.inputs.index_select(0, part), rows.targets.index_select(0, part),
            lo.first_batch + (*next)++};
    return b;
  };
}

}  // namespace scaletrain
