// Note [Global losses]
// ~~~~~~~~~~~~~~~~~~~~
// A step's loss (metrics.jsonl's step lines, TensorBoard's train/loss, StepReport::loss, the
// progress line's running mean) and an epoch's loss mean one thing at every layout: the loss of
// the global batch, as one process computing it whole would give it. Each data replica's loss
// is a mean over its share of the batch, so the global one is those means weighted by the
// targets each averaged over (loss_weight(): a text batch's tokens, a batch's samples), summed
// over the replicas, over the sum of the weights. One rank per replica counts
// (TrainStrategy::counts_loss()): a tensor-parallel group's ranks each compute the same loss of
// their replica's batch, and a grid's last stage is the one that computes it. The epoch's loss
// is the same weighting over all of its steps: Σ loss·weight over Σ weight.
//
// Each rank keeps its own running sums (LossSum) and the trainer sums them over the world where
// it reads the steps (Run::settle, one all-reduce of every pending step's sums and the epoch's so
// far) and at the epoch's end. A checkpoint holds every rank's sums; a resume at another layout
// gives their total to rank 0 and nothing to the others, which is right because no replica's
// loss was counted twice. Regression (EpochLossAfterResumeOnAnotherLayoutWasUnweighted): the
// sums used to be per rank and unweighted (one count per rank and step), so a tp 2 run resumed
// at dp 2 × tp 2 counted each step before the resume twice (two ranks of one replica) and each
// step after it four times (two replicas' half-batch losses, each on two ranks): the epoch's
// loss was the plain mean of the two parts' means. Regression
// (StepLossWasRankZerosShareUnderDdp): the step lines gave rank 0's own loss, its share of the
// batch under ddp and the whole batch under tp.
//
// Where the ranks have different numbers of batches in an epoch (UnevenInputs::kJoin), they meet
// in no collective before the epoch's end: a step's loss is then this rank's share, and only
// the epoch's loss is the global one.

#include "train/loss_sums.h"

#include <ATen/ops/scalar_tensor.h>

namespace scaletrain {

at::Tensor loss_weight(const at::Tensor& targets) {
  if (!at::isFloatingType(targets.scalar_type()) && targets.dim() > 0) {
    return (targets != -100).sum();
  }
  const int64_t samples = targets.dim() > 0 ? targets.size(0) : 1;
  return at::scalar_tensor(samples, at::TensorOptions(at::kLong).device(targets.device()));
}

LossSum restored_loss_sums(const at::Tensor& rows, int rank, int world) {
  const at::Tensor r = rows.to(at::kDouble).cpu().reshape({-1, 2});
  if (r.size(0) == world) return {r[rank][0].item<double>(), r[rank][1].item<double>()};
  if (rank != 0) return {};
  const at::Tensor total = r.sum(0);
  return {total[0].item<double>(), total[1].item<double>()};
}

LossSum restored_unweighted_loss_sums(const at::Tensor& rows, int rank, int64_t steps,
                                      double step_weight) {
  if (rank != 0 || steps < 1) return {};
  const at::Tensor total = rows.to(at::kDouble).cpu().reshape({-1, 2}).sum(0);
  const double counted = total[1].item<double>();
  if (counted <= 0) return {};
  const double weight = static_cast<double>(steps) * step_weight;
  return {total[0].item<double>() / counted * weight, weight};
}

}  // namespace scaletrain
