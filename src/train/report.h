#pragma once
// What the trainer tells (internal): on rank 0, metrics.jsonl lines, TensorBoard scalars, the
// progress bar and the epoch lines (docs/training.md, "Output").

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>

#include "scaletrain/tensorboard.h"
#include "scaletrain/trainer.h"

namespace scaletrain {

class Reporter {
 public:
  /// Reports only when `active` (rank 0); appends to out_dir/metrics.jsonl.
  Reporter(const TrainerOptions& options, bool active);

  /// After a step: the progress bar (`mean_loss` of the epoch so far), and every log_every
  /// steps a metrics line and TensorBoard scalars of `loss` (this step's).
  void step(int64_t epoch, int64_t done, int64_t total, int64_t global_step, double loss,
            double mean_loss, double lr, double seconds);
  /// After an epoch: its line everywhere.
  void epoch(const EpochReport& report);

  const std::string& metrics_path() const { return metrics_path_; }

 private:
  void progress(int64_t epoch, int64_t done, int64_t total, double loss, double seconds);

  const TrainerOptions& o_;
  bool active_;
  std::string metrics_path_;
  std::ofstream metrics_;
  std::unique_ptr<EventWriter> tb_;
};

}  // namespace scaletrain
