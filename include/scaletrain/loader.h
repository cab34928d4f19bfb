#pragma once
// Batches prepared ahead of the training loop, by background threads.
//
//   LoaderOptions lo;
//   lo.batch_size = 128;
//   Loader loader(batches_of(train_set), sampler.remaining(), lo);
//   while (auto b = loader.next()) step(b->inputs, b->targets);
//
// A Loader cuts a list of sample indices into batches and has `workers` threads build them
// (gather rows, or decode and augment images) up to `prefetch` batches per worker ahead of the
// consumer. Batches come out in order, and what a batch holds depends only on its indices and
// on (seed, batch number) — never on which thread built it or when — so a run is repeatable and
// a resumed run sees the same batches. workers = 0 builds each batch in next(). An exception in
// a worker is raised again by next(). With pin_memory (CUDA only) batches are in page-locked
// memory, ready for a non-blocking copy to the device.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace scaletrain {

struct Dataset;
class ImageFolder;

struct Batch {
  at::Tensor inputs;   // the model's input rows (images, token windows, features)
  at::Tensor targets;  // what the loss compares the output with (classes, next tokens)
  int64_t index = 0;   // number of the batch in this loader
};

/// Builds the batch holding rows `indices`; `seed` drives any random augmentation.
using BatchFn = std::function<Batch(const std::vector<int64_t>& indices, uint64_t seed)>;

/// Rows of an in-memory data set (no augmentation).
BatchFn batches_of(std::shared_ptr<const Dataset> dataset);
/// Decoded, transformed images of a folder.
BatchFn batches_of(std::shared_ptr<const ImageFolder> folder);

/// The most background threads one Loader starts. A batch needs one thread at most, and a
/// machine's cores bound what helps: a count past this is a typo, not a setting (100000 made
/// every rank start threads until the process could start no more).
constexpr int kMaxLoaderWorkers = 256;

struct LoaderOptions {
  int64_t batch_size = 64;
  int workers = 1;   // background threads, 0 to kMaxLoaderWorkers; 0: on the caller's thread
  int prefetch = 2;  // batches each worker may hold ready
  bool drop_last = false;
  bool pin_memory = false;  // needs CUDA; ignored without it
  uint64_t seed = 0;
  int64_t first_batch = 0;  // number of the first batch (a resumed epoch starts further on);
                            // it counts in the augmentation seeds and in Batch::index
};

class Loader {
 public:
  /// Throws UsageError naming the value for batch_size < 1, workers outside [0,
  /// kMaxLoaderWorkers] or prefetch < 1, and Error when the system refuses a thread (the ones
  /// already started are stopped first).
  Loader(BatchFn build, std::vector<int64_t> indices, LoaderOptions options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  /// The next batch in order, or nothing after the last.
  std::optional<Batch> next();
  int64_t num_batches() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace scaletrain
