#pragma once
// Checkpoints: the whole training state in one file, written atomically (temporary file,
// fsync, rename) with a CRC-32 of its contents, so that a crash leaves either the old file or
// the new one, and a damaged file is recognised instead of loaded. Format: docs/checkpoint.md.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/sampler.h"

namespace scaletrain {

struct TrainingState {
  std::string run_id;  // the run the checkpoint belongs to (Note [Run identity] in training.md):
                       // letters, digits, '-' and '_'; pruning never touches another run's files
  std::string model_name;
  int64_t epoch = 0;          // the epoch in progress
  int64_t step_in_epoch = 0;  // batches of it already done
  int64_t global_step = 0;
  SamplerState sampler;
  /// The program's own state, saved and loaded with the rest: named tensors (a GradScaler's
  /// state(), an EMA of the weights...) and named strings (a JSON of an LR scheduler's state...).
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> values;
  /// load_checkpoint(): whether the file held an optimizer state and it was loaded.
  bool optimizer_restored = false;
  /// load_checkpoint(): false for a DCP folder another program wrote (Python's dcp.save of
  /// get_state_dict()'s {"model": ..., "optim": ...}): it holds weights and maybe an optimizer's
  /// state, but no training position, so epoch, steps and sampler are zeros (a start from them).
  bool has_training_state = true;
};

/// Random number generators' states (the CPU's and each GPU's default generator), as named
/// tensors for TrainingState::tensors ("rng/cpu", "rng/cuda:0"...): restore_rng() puts them
/// back, so that dropout and random augmentation continue as if never interrupted. These are
/// this process's only: with several ranks, where only rank 0 writes the file, use rng.h's
/// gather_rng_states() / restore_rng_states(), which carry every rank's (and seed each rank's
/// stream apart with rank_seed()).
std::map<std::string, at::Tensor> rng_state();
void restore_rng(const std::map<std::string, at::Tensor>& tensors);

/// `dir/ckpt-<global_step>.st`, the file save_checkpoint() writes for that step.
std::string checkpoint_path(const std::string& dir, int64_t global_step);

/// How a checkpoint lies on disk. kFile: one file, `ckpt-<step>.st`, scaletrain's own format.
/// kDcp: a folder, `ckpt-<step>/`, in the layout of PyTorch's torch.distributed.checkpoint
/// (distributed_checkpoint.h), which Python's dcp.load reads: the model's tensors as
/// "model.<name>", an SGD, Adam or AdamW's state under get_state_dict()'s "optim." names, the
/// rest of the state under "scaletrain." (docs/checkpoint.md), and a record of its files'
/// checksums beside them. Either loads, resumes and prunes the same way; a folder may hold both.
enum class CheckpointLayout { kFile, kDcp };
/// `dir/ckpt-<global_step>`, the folder save_checkpoint() writes for that step with kDcp.
std::string dcp_checkpoint_path(const std::string& dir, int64_t global_step);

/// Writes `dir/ckpt-<global_step>.st` atomically and removes all but the newest `keep` of the
/// checkpoints in `dir` that belong to the same run (state.run_id); other runs' files are never
/// touched. Call it on one rank (rank 0): ranks that call it at once do not collide (each writes
/// a temporary of its own and the last rename wins), but write the same file several times. Returns
/// the path. Throws Error when the folder cannot be written, and UsageError for a run id with other
/// characters than letters, digits, '-' and '_'.
std::string save_checkpoint(const std::string& dir, const TrainingState& state,
                            const torch::nn::Module& model, const torch::optim::Optimizer& opt,
                            int keep);
/// The same with the optimizer's state left out when `opt` is null (a program that keeps it in
/// TrainingState::tensors itself, as the trainer's pipeline grid does, one per stage).
std::string save_checkpoint(const std::string& dir, const TrainingState& state,
                            const torch::nn::Module& model, const torch::optim::Optimizer* opt,
                            int keep);
/// The same in `layout`: with kDcp, the folder `dir/ckpt-<global_step>` (replacing one of that
/// name), atomically; pruning counts the run's files and folders together.
std::string save_checkpoint(const std::string& dir, const TrainingState& state,
                            const torch::nn::Module& model, const torch::optim::Optimizer* opt,
                            int keep, CheckpointLayout layout);

struct AsyncCheckpointOptions {
  /// Called on the writer thread with the checkpoint's path before it serialises the snapshot:
  /// for tests that change the model meanwhile.
  std::function<void(const std::string& path)> before_serialize;
  /// Called on the writer thread with the temporary file's path once it is written and synced,
  /// just before it is renamed to the checkpoint's name: for tests of a crash at that moment.
  std::function<void(const std::string& temporary)> before_rename;
  /// The layout of the checkpoints written (kDcp: the temporary is a folder).
  CheckpointLayout layout = CheckpointLayout::kFile;
};

/// Writes checkpoints in the background (PyTorch DCP's async_save): save() blocks only while it
/// takes a snapshot in memory (copies of the model's parameters and buffers, of the optimizer's
/// state and of TrainingState's tensors, on the CPU), and a thread of its own serialises it and
/// writes the file as save_checkpoint() does (atomically, with its CRC, pruning the run's older
/// files). The training may change the model and optimizer as soon as save() returns. One write
/// at a time: save() first waits for the previous write. A crash during a write leaves the
/// previous checkpoint as it was (and no file under the new one's name).
///
/// The optimizer's state is copied tensor by tensor for torch::optim::SGD, Adam and AdamW; any
/// other optimizer's state is serialised within save() itself (correct, but the step loop then
/// waits for that serialisation too). A write that fails is thrown (as the Error that
/// save_checkpoint() would throw) from the next save() or wait(); the destructor waits for the
/// write in progress and reports a failure on stderr.
class AsyncCheckpointer {
 public:
  explicit AsyncCheckpointer(AsyncCheckpointOptions options = {});
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  /// As save_checkpoint(), in the background; returns the path the file will have.
  std::string save(const std::string& dir, const TrainingState& state,
                   const torch::nn::Module& model, const torch::optim::Optimizer* opt, int keep);
  /// Waits for the write in progress, if any; throws its failure.
  void wait();
  /// Whether a write is in progress.
  bool busy() const;
  /// The newest checkpoint this writer has finished writing; "" before the first.
  std::string last_written() const;

  /// Where the last save() spent its time, in seconds: waiting for the write before it, and
  /// taking the snapshot (together, what the step loop waited); and the write itself
  /// (serialising and writing the file in the background; set when it ends).
  struct Timing {
    double waited = 0, snapshot = 0, write = 0;
  };
  Timing timing() const;

 private:
  std::string save_folder(const std::string& dir, const TrainingState& state,
                          const torch::nn::Module& model, const torch::optim::Optimizer* opt,
                          int keep, Timing timing, std::chrono::steady_clock::time_point t0);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Reads a checkpoint, a file or a folder (CheckpointLayout), into `model` and `opt` (tensors are
/// copied onto the devices the model's own parameters are on, whatever device they were saved
/// from), and returns the rest of the state, the program's own tensors and values included. Throws
/// Error for a truncated or corrupt file and for a key that is missing or has another shape (naming
/// the file and the key), and UsageError for a checkpoint of another model. A DCP folder another
/// program wrote (Python's dcp.save of get_state_dict()) loads too: its weights, and its optimizer
/// state into a standard `opt` over the model's parameters; it holds no training position
/// (TrainingState::has_training_state is false).
TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Optimizer& opt, const std::string& model_name);
/// The same, loading the optimizer's state only when `opt` is given and the file has one
/// (TrainingState::optimizer_restored says whether it did); never throws for its absence.
TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Optimizer* opt, const std::string& model_name);

/// The newest checkpoint in `dir` whose checksum is right; damaged ones are skipped and reported
/// on stderr (report_skipped()). nullopt when there is none.
std::optional<std::string> newest_valid_checkpoint(const std::string& dir);

/// Says on stderr that a damaged checkpoint (`what`: the file and its fault) is skipped, once per
/// process for the same words.
void report_skipped(const std::string& what);

/// Checks a file's header and checksum without loading it; the reason when it is bad.
std::optional<std::string> checkpoint_problem(const std::string& path);

/// The run a checkpoint belongs to, from its header alone ("" for a format-1 file, which
/// predates run ids); nullopt when the file is not a readable checkpoint.
std::optional<std::string> checkpoint_run(const std::string& path);
/// A value a program stored in the checkpoint (TrainingState::values[key]); nullopt when the file
/// is unreadable or has no such value. Reads the whole file.
std::optional<std::string> checkpoint_value(const std::string& path, const std::string& key);

/// The model's weights (parameters and buffers) as a state dict for Python, with the Python
/// model's keys ("conv1.weight", "bn1.running_mean", ...): a path ending in ".safetensors" gets
/// the safetensors format (safetensors.torch.load_file), any other torch.save's format
/// (torch.load, weights_only or not). Tensors are saved from the CPU; written atomically.
void save_weights(const std::string& path, const torch::nn::Module& model);

/// Named tensors as one safetensors file (in this order; from the CPU), written atomically:
/// e.g. one shard of a Hugging Face folder.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors);

/// Loads a state dict into `model`, converting to the model's devices and dtypes: a file of
/// save_weights(), a safetensors file (Python: safetensors.torch.save_file(model.state_dict(),
/// path)), or torch.save of a plain dict (Python: torch.save(dict(model.state_dict()), path);
/// LibTorch cannot read the OrderedDict of a bare state_dict(), and the error says so), or a
/// folder of torch.distributed.checkpoint (Python: dcp.save({"model": model.state_dict()}, ...)
/// or dcp.save(model.state_dict(), ...); keys under "model." or at the top, whichever names more
/// of the model's; distributed_checkpoint.h), or a Hugging Face folder (save_pretrained's:
/// model.safetensors, or the shards model.safetensors.index.json lists). Every
/// key must match, with the same shape: otherwise Error naming the missing keys, the
/// unexpected ones and the shape mismatches, and `model` is left unchanged.
void load_weights(const std::string& path, torch::nn::Module& model);

/// The tensors of a weights file (as load_weights() reads it) or of a Hugging Face folder, by
/// name, on the CPU, for a program that renames or reshapes them before loading.
std::map<std::string, at::Tensor> read_weights(const std::string& path);

/// load_weights() from tensors the program holds; `source` names them in the errors.
void load_state_dict(std::map<std::string, at::Tensor> state, torch::nn::Module& model,
                     const std::string& source);

}  // namespace scaletrain
