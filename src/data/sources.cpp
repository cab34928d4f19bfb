// The trainer's data sources (trainer.h): a size and a batch function over the data sets of
// data.h and image_folder.h.

#include <torch/nn/functional/loss.h>

#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/image_folder.h"
#include "scaletrain/trainer.h"

namespace scaletrain {

DataSource in_memory(Dataset d, int64_t limit) {
  if (limit > 0 && limit < d.size()) {
    d.images = d.images.narrow(0, 0, limit);
    d.labels = d.labels.narrow(0, 0, limit);
  }
  DataSource s;
  s.size = d.size();
  s.batch = batches_of(std::make_shared<const Dataset>(std::move(d)));
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

Metric accuracy() {
  return {"test_accuracy", [](const at::Tensor& out, const at::Tensor& y) {
            check_class_shapes(out, y, "accuracy()");
            // The classes are the output's last dimension; a sequence's sample scores the
            // mean over its positions.
            auto right = out.argmax(-1).eq(y.to(out.device())).to(at::kDouble);
            return right.dim() > 1 ? right.flatten(1).mean(1) : right;
          }};
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
