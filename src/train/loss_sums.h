#pragma once
// The training loss the trainer reports (internal): what a step's loss and an epoch's loss mean,
// whatever the layout. Note [Global losses] in loss_sums.cpp.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

namespace scaletrain {

/// The checkpoint's key of every rank's running sums of the epoch (rows of {Σ loss·weight,
/// Σ weight}, by rank), and the key older files hold instead (rows of {Σ loss, steps}: each
/// rank's own losses, unweighted).
inline constexpr const char* kEpochLossKey = "trainer/epoch_loss_sums";
inline constexpr const char* kUnweightedEpochLossKey = "trainer/epoch_loss";

/// How many targets a batch's loss averages over, as a scalar tensor on the targets' device (so
/// that nothing waits for the device: it is read with the loss, Note [Deferred reads]): integer
/// targets other than PyTorch's ignore index (-100, which the default loss, the GPT's and
/// token_loss() leave out), so a text batch counts its tokens and a batch of classes its
/// samples; floating-point targets (class probabilities, regression values) one per sample.
at::Tensor loss_weight(const at::Tensor& targets);

/// A running sum of losses, each weighted by the targets it averages over.
struct LossSum {
  double sum = 0;     // Σ loss · weight
  double weight = 0;  // Σ weight

  /// Adds a loss of `w` targets; nothing for w = 0 (a batch whose targets are all ignored: its
  /// loss is NaN and means nothing).
  void add(double loss, double w) {
    if (w > 0) sum += loss * w, weight += w;
  }
  /// The weighted mean; NaN with no weight.
  double mean() const {
    return weight > 0 ? sum / weight : std::numeric_limits<double>::quiet_NaN();
  }
};

/// This rank's share of the running sums saved under kEpochLossKey (`rows`: one row per rank of
/// the world that saved them). At the same world each rank takes its own row; at another, rank 0
/// takes their total and the others nothing: each replica's losses were counted once, so the
/// total is the epoch's whatever the layout that saved it.
LossSum restored_loss_sums(const at::Tensor& rows, int rank, int world);

/// The same from a file written before the sums were weighted (kUnweightedEpochLossKey): the
/// mean of its rows stands for `steps` steps of `step_weight` targets each, carried by rank 0.
/// Exact where every step had the same targets (the same global batch, nothing ignored) and the
/// file was written at one rank per replica or with a replica's ranks counting alike.
LossSum restored_unweighted_loss_sums(const at::Tensor& rows, int rank, int64_t steps,
                                      double step_weight);

}  // namespace scaletrain
