// The trainer's data sources (data_source.h): a size and a batch function over the data sets of
// data.h and image_folder.h.

#include "scaletrain/data_source.h"

#include <torch/nn/functional/loss.h>

#include <cmath>
#include <limits>

#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/image_folder.h"

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

}  // namespace scaletrain
