#pragma once
// The trainer's data: one split of a data set as a size and a function from indices to a batch
// (DataSource), over in-memory data sets (data.h), image folders (image_folder.h), LibTorch data
// sets and token files (tokens.h). trainer.h takes a TrainTask of them.

#include <ATen/ops/stack.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "scaletrain/loader.h"

namespace scaletrain {

struct Dataset;
class ImageFolder;

/// One split of a data set as the trainer reads it: how many samples, and the batch of any of
/// them (loader.h: Batch::inputs go into the model, Batch::targets into the loss; `seed` drives
/// any random augmentation, so a batch depends only on its indices and seed).
struct DataSource {
  int64_t size = 0;
  BatchFn batch;
  /// The rows themselves, where the split is an in-memory data set (in_memory() sets them):
  /// TrainerOptions::data_on_device then keeps them on the device and gathers batches there,
  /// without calling `batch`. A program that wraps in_memory()'s `batch` (to transform its
  /// batches) resets `rows`, so that data_on_device refuses the split instead of bypassing it.
  std::shared_ptr<const Dataset> rows;
};

/// An in-memory data set (data.h: Fashion-MNIST, synthetic...), rows [0, limit) when limit > 0.
DataSource in_memory(Dataset data, int64_t limit = 0);
/// An image folder (image_folder.h), decoded and augmented on the loader's threads; `limit` > 0
/// keeps that many images spread over the folder (every class stays in).
DataSource image_folder(std::shared_ptr<const ImageFolder> folder, int64_t limit = 0);
/// A LibTorch data set (torch::data::datasets::Dataset with Example<> samples of a tensor and a
/// target): a batch stacks get(i) of its indices.
template <typename D>
DataSource torch_dataset(std::shared_ptr<D> data) {
  DataSource s;
  s.size = static_cast<int64_t>(data->size().value());
  s.batch = [data](const std::vector<int64_t>& indices, uint64_t) {
    std::vector<at::Tensor> xs, ys;
    for (int64_t i : indices) {
      auto example = data->get(static_cast<size_t>(i));
      xs.push_back(example.data);
      ys.push_back(example.target);
    }
    return Batch{at::stack(xs), at::stack(ys), 0};
  };
  return s;
}

}  // namespace scaletrain
