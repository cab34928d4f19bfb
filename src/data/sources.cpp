// The trainer's data sources (trainer.h): a size and a batch function over the data sets of
// data.h and image_folder.h.

#include <torch/nn/functional/loss.h>

#include <cmath>

#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/image_folder.h"
#include "scaletrain/trainer.h"

namespace scaletrain {

DataSource in_memory(Dataset d, int64_t limit) {
  if (limit > 0 && limit < d.size()) {
    d.inputs = d.inputs.narrow(0, 0, limit);
    d.targets = d.targets.narrow(0, 0, limit);
  }
  DataSource s;
  s.size = d.size();
  s.rows = std::make_shared<const Dataset>(std::move(d));
  s.batch = batches_of(s.rows);
  return s;
}

DataSource image_folder(std::shared_ptr<const ImageFolder> folder, int64_t limit) {
  DataSource s;
  s.size = folder->size();
  s.batch = batches_of(folder);
  if (limit > 0 && limit < folder->size()) {
    // A spread of the folder (every k-th image), so that every class stays in.
    const int64_t n = folder->size();
    auto inner = s.batch;
    s.batch = [inner, n, limit](const std::vector<int64_t>& idx, uint64_t seed) {
      std::vector<int64_t> spread;
      for (int64_t i : idx) spread.push_back(i * n / limit);
      return inner(spread, seed);
    };
    s.size = limit;
  }
  return s;
}

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

Metric::PerSample positions_counted(int64_t ignore) {
  return [ignore](const at::Tensor&, const at::Tensor& y) { return counted(y, ignore).sum(1); };
}

}  // namespace

Metric accuracy(int64_t ignore_index) {
  Metric m{"test_accuracy", [ignore_index](const at::Tensor& out, const at::Tensor& y) {
             check_class_shapes(out, y, "accuracy()");
             // The classes are the output's last dimension; a sequence's sample scores the
             // mean over its positions.
             auto yy = y.to(out.device());
             return sample_mean(out.argmax(-1).eq(yy), yy, ignore_index);
           }};
  m.weight = positions_counted(ignore_index);
  return m;
}

Metric token_loss(int64_t ignore_index) {
  Metric m{"test_loss", [ignore_index](const at::Tensor& out, const at::Tensor& y) {
             check_class_shapes(out, y, "token_loss()");
             auto yy = y.to(out.device());
             auto ce = at::cross_entropy_loss(out.reshape({-1, out.size(-1)}), yy.reshape({-1}), {},
                                              at::Reduction::None, ignore_index);
             return sample_mean(ce.reshape(yy.sizes()), yy, ignore_index);
           }};
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
