// The trainer's metrics (trainer.h): accuracy, token loss and perplexity, on the whole output
// or on one split over the classes.

#include <torch/nn/functional/loss.h>

#include <cmath>
#include <limits>

#include "scaletrain/error.h"
#include "scaletrain/trainer.h"

namespace scaletrain {

namespace {

// Each sample's targets that count: 1 where the target is not `ignore`, per position.
at::Tensor counted(const at::Tensor& y, int64_t ignore) {
  auto keep = y.ne(ignore).to(at::kDouble);
  return keep.dim() > 1 ? keep.flatten(1) : keep.unsqueeze(1);
}

// A per-position value [batch, positions...] (or [batch]) as each sample's mean over the
// positions that count (0 where none does).
at::Tensor sample_mean(const at::Tensor& value, const at::Tensor& y, int64_t ignore) {
  auto keep = counted(y, ignore);
  auto v = value.to(at::kDouble).reshape({value.size(0), -1}) * keep;
  return v.sum(1) / keep.sum(1).clamp_min(1);
}

// Regression (SplitPathScoredOutOfVocabularyTargetsSilently): a target (other than `ignore`) is
// one of the output's `classes` ids, or a UsageError names it and its sample, on the whole path
// and the class-split one alike (the split path scored such a target silently: never a hit, a
// loss from a clamped id). Every rank of a split holds the same targets, so all refuse together;
// the trainer's evaluation carries a refusal to the other replicas (run_evaluate.cpp).
void check_targets(const at::Tensor& y, int64_t classes, int64_t ignore, const std::string& who) {
  const auto bad = y.ne(ignore).logical_and(y.lt(0).logical_or(y.ge(classes))).flatten();
  if (!bad.any().item<bool>()) return;
  const int64_t first = bad.nonzero()[0][0].item<int64_t>();
  const int64_t per_sample = y.dim() > 0 && y.size(0) > 0 ? y.numel() / y.size(0) : 1;
  throw UsageError(who + ": target " + std::to_string(y.flatten()[first].item<int64_t>()) +
                   " of the batch's sample " + std::to_string(first / per_sample) +
                   " is outside the output's " + std::to_string(classes) + " classes (0 to " +
                   std::to_string(classes - 1) + "; " + std::to_string(ignore) +
                   ", the ignore index, is left out): the data's targets must be ids of the "
                   "model's classes");
}

Metric::PerSample positions_counted(int64_t ignore) {
  return [ignore](const at::Tensor&, const at::Tensor& y) { return counted(y, ignore).sum(1); };
}

// Each position's class of largest output over a class-split output: every rank's largest of its
// slice and that class's id, gathered (two numbers per position and rank); the largest wins, the
// lowest id among equals, as at::argmax picks the first.
at::Tensor split_argmax(const at::Tensor& slice, const ClassSlice& where) {
  auto [value, index] = slice.max(-1);
  auto values = at::stack(where.group->all_gather(value.contiguous(), "accuracy()"));
  auto ids = at::stack(where.group->all_gather((index + where.offset).contiguous(), "accuracy()"));
  auto best = std::get<0>(values.max(0));
  auto lowest = at::where(values.eq(best), ids, std::numeric_limits<int64_t>::max());
  return std::get<0>(lowest.min(0));
}

// Each position's cross entropy over a class-split output (the vocabulary-parallel cross
// entropy's three all-reduces, per position): log sum exp over every slice, less the target's
// output, which one rank holds. Ignored targets give 0.
at::Tensor split_cross_entropy(const at::Tensor& slice, const at::Tensor& y,
                               const ClassSlice& where, int64_t ignore) {
  auto top = std::get<0>(slice.max(-1)).contiguous();
  where.group->all_reduce(top, ReduceOp::MAX, "token_loss()");
  auto sum = at::exp(slice - top.unsqueeze(-1)).sum(-1).contiguous();
  where.group->all_reduce(sum, ReduceOp::SUM, "token_loss()");
  const int64_t width = slice.size(-1);
  auto local = y.ge(where.offset).logical_and(y.lt(where.offset + width)).logical_and(y.ne(ignore));
  auto at_target = slice.gather(-1, (y - where.offset).clamp(0, width - 1).unsqueeze(-1));
  auto target = at::where(local, at_target.squeeze(-1), at::zeros_like(top)).contiguous();
  where.group->all_reduce(target, ReduceOp::SUM, "token_loss()");
  return at::where(y.ne(ignore), at::log(sum) + top - target, at::zeros_like(top));
}

}  // namespace

Metric accuracy(int64_t ignore_index) {
  Metric m{"test_accuracy", [ignore_index](const at::Tensor& out, const at::Tensor& y) {
             check_class_shapes(out, y, "accuracy()");
             // The classes are the output's last dimension; a sequence's sample scores the
             // mean over its positions.
             auto yy = y.to(out.device());
             check_targets(yy, out.size(-1), ignore_index, "accuracy()");
             return sample_mean(out.argmax(-1).eq(yy), yy, ignore_index);
           }};
  m.per_sample_split = [ignore_index](const at::Tensor& slice, const at::Tensor& y,
                                      const ClassSlice& where) {
    check_class_shapes(slice, y, "accuracy()");
    auto yy = y.to(slice.device());
    check_targets(yy, slice.size(-1) * where.group->size(), ignore_index, "accuracy()");
    return sample_mean(split_argmax(slice, where).eq(yy), yy, ignore_index);
  };
  m.weight = positions_counted(ignore_index);
  return m;
}

Metric token_loss(int64_t ignore_index) {
  Metric m{"test_loss", [ignore_index](const at::Tensor& out, const at::Tensor& y) {
             check_class_shapes(out, y, "token_loss()");
             auto yy = y.to(out.device());
             check_targets(yy, out.size(-1), ignore_index, "token_loss()");
             auto ce = at::cross_entropy_loss(out.reshape({-1, out.size(-1)}), yy.reshape({-1}), {},
                                              at::Reduction::None, ignore_index);
             return sample_mean(ce.reshape(yy.sizes()), yy, ignore_index);
           }};
  m.per_sample_split = [ignore_index](const at::Tensor& slice, const at::Tensor& y,
                                      const ClassSlice& where) {
    check_class_shapes(slice, y, "token_loss()");
    auto yy = y.to(slice.device());
    check_targets(yy, slice.size(-1) * where.group->size(), ignore_index, "token_loss()");
    // bf16/fp16 outputs (the sharded strategies' parameters) in float32, so that the log of the
    // sum does not round at the logits' size.
    const auto s = at::isReducedFloatingType(slice.scalar_type()) ? slice.to(at::kFloat) : slice;
    return sample_mean(split_cross_entropy(s, yy, where, ignore_index), yy, ignore_index);
  };
  m.weight = positions_counted(ignore_index);
  return m;
}

Metric perplexity(int64_t ignore_index) {
  Metric m = token_loss(ignore_index);
  m.name = "test_perplexity";
  m.finish = [](double mean_loss) { return std::exp(mean_loss); };
  return m;
}

void check_class_shapes(const at::Tensor& out, const at::Tensor& y, const std::string& who) {
  const bool classes = out.dim() == y.dim() + 1 && out.dim() >= 2 &&
                       !at::isFloatingType(y.scalar_type()) &&
                       out.sizes().slice(0, static_cast<size_t>(y.dim())) == y.sizes();
  if (!classes) {
    throw UsageError(who +
                     " takes outputs of shape [..., classes] and integer targets of the "
                     "same shape without the classes; got outputs " +
                     c10::str(out.sizes()) + " and targets " + c10::str(y.sizes()) + " (" +
                     c10::toString(y.scalar_type()) +
                     "): give the task a loss and metrics of its own (TrainTask::loss, ::metrics)");
  }
}

}  // namespace scaletrain
