#pragma once
// The output folder of a training run (internal). Note [Run identity] in run_folder.cpp.

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/trainer.h"

namespace scaletrain {

/// How a run starts in its output folder.
struct RunStart {
  std::optional<std::string> resume_from;  // the checkpoint to load, if any
  std::string run_id;                      // a fresh run's id ("" when resuming: the checkpoint's)
  std::vector<std::filesystem::path> stale;  // files to delete first (--overwrite, or an
                                             // earlier attempt's metrics)
};

/// The files a training run writes in `dir`: checkpoints (and their temporaries), metrics.jsonl,
/// TensorBoard event files, model.pt, run.json. Nothing else in the folder is ever touched.
std::vector<std::filesystem::path> run_files(const std::string& dir);

/// Decides how a run with options `o` starts in o.out_dir, reading the folder and the launcher's
/// environment, writing nothing. Throws UsageError when the folder holds another run's files
/// and the options neither resume it nor say --overwrite.
RunStart plan_run_start(const TrainerOptions& o);

/// Rank 0, before training: deletes `start.stale` and records the run in out_dir/run.json.
void begin_run(const TrainerOptions& o, const RunStart& start, const std::string& run_id,
               const std::string& model_name);

/// Keeps the metrics lines of steps up to `step` (a resumed run redoes the later ones).
void drop_metrics_after(const std::string& path, int64_t step);

}  // namespace scaletrain
