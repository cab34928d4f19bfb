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
// JSON object per logged step and per epoch, docs/training.md), events.out.tfevents.* (the same
// metrics for TensorBoard), model.pt (the final weights as a state dict for Python's
// torch.load).

#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/dist.h"

namespace scaletrain {

struct TrainOptions {
  std::string model = "lenet";
  std::string dataset = "fashion-mnist";  // "synthetic", or "folder": data_dir holds train/
                                          // and val/, ImageNet-style (image_folder.h)
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int64_t image_size = 224;  // folder data: crop size
  int64_t limit_train = 0;   // >0: use only the first N training samples
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
  bool overwrite = false;       // out_dir holds another run: delete its files and start afresh
                                // (without it, such a folder is refused unless resumed)
  int log_every = 50;           // steps between metric lines
  bool progress = true;         // progress bar / lines on rank 0
  std::string device = "auto";  // "auto" (cuda:<local rank> when GPUs are visible, else cpu),
                                // "cpu", "cuda" or "cuda:N"
  std::string amp = "none";     // mixed precision: "none", "bf16", "fp16" (with loss scaling)
  int workers = 1;              // loader threads per rank (0: load on the training thread)
  std::string init_weights;     // a state dict (Python's torch.save) to start from
  bool tensorboard = true;      // events.out.tfevents.* in out_dir (rank 0)
  bool channels_last = true;    // convolution weights and image batches in NHWC memory
                                // (to_channels_last in models.h): faster on CPU and GPU
  double timeout_s = 300;       // collective timeout (InitOptions::timeout): how long a rank waits
                                // for the others in one collective before failing, naming it
  std::string uneven_inputs = "fail";  // ranks with different batch counts (ddp.h's
                                       // UnevenInputs): "fail" within a step, naming them, or
                                       // "join" (the others finish the epoch)
};

struct TrainResult {
  double test_accuracy = 0;
  double final_loss = 0;
  std::vector<double> epoch_seconds;
  double samples_per_second = 0;  // training samples over all ranks
  int64_t global_step = 0;
  std::string last_checkpoint;
  std::string metrics_path;
  std::string weights_path;       // model.pt (rank 0)
  std::string device;             // this rank's
  int64_t peak_memory_bytes = 0;  // this rank's device: CUDA peak allocated, or CPU peak RSS
};

/// Checks the options before any work (unknown model or data set, a batch smaller than the
/// world size, an unwritable output folder, a folder holding another run that is neither resumed
/// nor overwritten): throws UsageError naming the value and the fix. Writes nothing but the
/// output folder itself.
void validate(const TrainOptions& options, int world_size);

/// Trains on this rank; every rank calls it with the same options.
TrainResult train(const TrainOptions& options, const Dist& dist);

}  // namespace scaletrain
