#pragma once
// The output folder of a training run (internal). Note [Run identity] in run_folder.cpp.

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/trainer.h"

namespace scaletrain {

/// The output folder's owner (Note [Folder owner] in run_folder.cpp): an exclusive lock on
/// `dir/.scaletrain.lock` (an open file description's), which the kernel releases when the
/// holder exits, however it exits.
/// The file names the holder (process, host, start) for the error a second run gets.
class FolderLock {
 public:
  /// Takes the lock, or throws UsageError naming the live run that holds it. A file system
  /// without locks (some network ones) takes none, silently.
  explicit FolderLock(const std::string& dir);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

  /// Whether another open file (this process's too) holds `dir`'s lock now: its description, or
  /// nullopt. Takes nothing.
  static std::optional<std::string> holder(const std::string& dir);

 private:
  int fd_ = -1;
};

/// How a run starts in its output folder.
struct RunStart {
  std::optional<std::string> resume_from;  // the checkpoint to load, if any
  std::optional<int64_t> resume_sharded;   // or: the step of the sharded one in out_dir
  int resume_sharded_tp = 1;               // the tensor-parallel degree it was saved at
  std::string run_id;                      // a fresh run's id ("" when resuming: the checkpoint's)
  std::vector<std::filesystem::path> stale;  // files to delete first (--overwrite, or an
                                             // earlier attempt's metrics)
};

/// Note [Sharded checkpoints per slice]: under tensor parallelism each slice t of T keeps its
/// sharded checkpoints (ZeRO's dir/world-<N>/rank-<r>/, N the data-parallel replicas) in
/// dir/tp<T>-<t>/, so that the slices' shards of one parameter never meet.
std::string tensor_slice_dir(const std::string& dir, int tp, int slice);

/// The newest sharded checkpoint in `dir` — ZeRO's own, or one whose every slice is complete —
/// and the tensor-parallel degree it was saved at (1 for ZeRO's own); nullopt when none.
struct ShardedFound {
  int64_t step = 0;
  int tp = 1;
};
std::optional<ShardedFound> newest_sharded(const std::string& dir);

/// The files a training run writes in `dir`: checkpoints (and their temporaries; the sharded
/// ones' world-<N> folders), metrics.jsonl,
/// TensorBoard event files, model.pt, run.json. Nothing else in the folder is ever touched.
std::vector<std::filesystem::path> run_files(const std::string& dir);

/// Decides how a run with options `o` starts in o.out_dir, reading the folder and the launcher's
/// environment, writing nothing. Throws UsageError when the folder holds another run's files
/// and the options neither resume it nor say --overwrite.
RunStart plan_run_start(const TrainerOptions& o);

/// Rank 0, before training: deletes `start.stale` and records the run in out_dir/run.json.
void begin_run(const TrainerOptions& o, const RunStart& start, const std::string& run_id,
               const std::string& model_name);

/// Rank 0 of the run that owns `dir`, while no rank of it writes (Note [Folder cleanup] in
/// run_folder.cpp): removes the temporaries of run files (checkpoints, shards, model.pt,
/// run.json, metrics.jsonl) whose writer is no live process here, one killed mid-write. Returns
/// how many it removed.
int remove_dead_temporaries(const std::string& dir);

/// Whether `dir` holds sharded checkpoint folders (world-<N>/, tp<T>-<t>/).
bool holds_sharded_checkpoints(const std::string& dir);

/// Once a full checkpoint of `step` is on disk: removes run `run_id`'s sharded checkpoints of
/// steps up to `step` from `dir`, and the folders that leaves empty (Note [Format switch]).
void remove_replaced_shards(const std::string& dir, const std::string& run_id, int64_t step);

/// Keeps the metrics lines of steps up to `step` (a resumed run redoes the later ones).
void drop_metrics_after(const std::string& path, int64_t step);

}  // namespace scaletrain
