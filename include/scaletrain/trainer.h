#pragma once
// The trainer behind `scaletrain train`: one process per rank, DistributedDataParallel across
// ranks (a world of one is fine), DistributedSampler slices, exact test accuracy, a progress
// bar on rank 0, metrics as JSON lines, checkpoints with exact resume.
//
//   auto dist = scaletrain::init_process_group();
//   scaletrain::TrainOptions o;            // LeNet on Fashion-MNIST
//   auto result = scaletrain::train(o, dist);
//
// Files under `out_dir`: ckpt-<step>.st (checkpoints, docs/checkpoint.md), metrics.jsonl (one
// JSON object per logged step and per epoch, docs/training.md).

#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/dist.h"

namespace scaletrain {

struct TrainOptions {
  std::string model = "lenet";
  std::string dataset = "fashion-mnist";  // or "synthetic"
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int64_t limit_train = 0;  // >0: use only the first N training samples
  int64_t limit_test = 0;
  int epochs = 5;
  int64_t batch_size = 256;       // global: split evenly over the ranks
  std::string optimizer = "sgd";  // "sgd" or "adam"
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 5e-4;
  std::string schedule = "none";  // "none", "step" (x gamma every step_size epochs), "cosine"
  int step_size = 2;
  double gamma = 0.5;
  int accumulate = 1;  // gradient accumulation: batches per optimizer step
  uint64_t seed = 0;
  std::string out_dir = "runs/latest";
  int checkpoint_every = 0;     // steps; 0: only at the end of each epoch
  int keep = 3;                 // checkpoints kept
  std::string resume = "auto";  // "auto" (newest valid in out_dir), "none", or a path
  int log_every = 50;           // steps between metric lines
  bool progress = true;         // progress bar / lines on rank 0
};

struct TrainResult {
  double test_accuracy = 0;
  double final_loss = 0;
  std::vector<double> epoch_seconds;
  double samples_per_second = 0;  // training samples over all ranks
  int64_t global_step = 0;
  std::string last_checkpoint;
  std::string metrics_path;
};

/// Checks the options before any work (unknown model or data set, a batch smaller than the
/// world size, an unwritable output folder): throws UsageError naming the value and the fix.
void validate(const TrainOptions& options, int world_size);

/// Trains on this rank; every rank calls it with the same options.
TrainResult train(const TrainOptions& options, const Dist& dist);

}  // namespace scaletrain
