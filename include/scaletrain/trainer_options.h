#pragma once
// How the trainer (trainer.h) trains: the strategy, the run's common options (epochs, batch,
// seed, output, checkpoints, logging, device) and each strategy's own, with the checks that
// refuse a combination before any work. Errors name the options as a program sets them
// (TrainerOptions::batch_size); the command line shows them as its flags.

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/ddp.h"
#include "scaletrain/fault_tolerance.h"
#include "scaletrain/parallel_dims.h"
#include "scaletrain/pipeline.h"

namespace scaletrain {

// ---- How it is trained ------------------------------------------------------------------------

enum class Strategy { kDDP, kDataParallel, kPipeline, kGrid, kZero1, kZero2, kFsdp };

/// How checkpoints are written (docs/checkpoint.md); kDcp is the default. kFull: one file, rank
/// 0's, with the whole model and optimizer state gathered to it. kSharded (zero1, zero2, fsdp):
/// each rank writes its own shard (zero.h's format, `out_dir/world-<N>/rank-<r>/ckpt-<step>.st`)
/// and nothing is gathered; it resumes at any world size and stage, and model.pt is still written
/// whole at the end. kDcp: as kFull, gathered to rank 0, written as a folder in PyTorch's
/// distributed checkpoint layout (`out_dir/ckpt-<step>/`, CheckpointLayout::kDcp in checkpoint.h)
/// that Python's torch.distributed.checkpoint reads (the default). Every format resumes from any
/// other's newest.
enum class CheckpointFormat { kFull, kSharded, kDcp };

/// "ddp", "dp", "pipeline", "grid", "zero1", "zero2", "fsdp"; throws UsageError naming them for
/// anything else.
Strategy parse_strategy(const std::string& name);
std::string to_string(Strategy s);

/// Mixed precision (amp.h): none; bf16 autocast (ddp, grid) or bf16 parameters over fp32 master
/// shards (zero1, zero2, fsdp); fp16 autocast with loss scaling (ddp).
enum class Amp { kNone, kBf16, kFp16 };
/// "none", "bf16", "fp16"; throws UsageError naming them for anything else.
Amp parse_amp(const std::string& name);
std::string to_string(Amp a);

/// "gpipe", "1f1b", "interleaved", "zb-h1"; throws UsageError naming them for anything else.
PipelineSchedule parse_schedule(const std::string& name);
std::string to_string(PipelineSchedule s);
/// "never", "except-last", "always"; throws UsageError naming them for anything else.
PipelineCheckpoint parse_pipeline_checkpoint(const std::string& name);
std::string to_string(PipelineCheckpoint c);

/// A device as PyTorch names it ("cpu", "cuda", "cuda:1"); throws UsageError naming `what` and
/// the value for anything else.
c10::Device parse_device(const std::string& name, const std::string& what = "device");

/// Where train() starts (TrainerOptions::resume).
struct Resume {
  enum class Kind {
    kAuto,  // the newest valid checkpoint in out_dir, else afresh
    kNone,  // afresh (a folder holding another run still needs TrainerOptions::overwrite)
    kFile,  // this checkpoint file
  };
  Kind kind = Kind::kAuto;
  std::string file;  // kFile

  static Resume automatic() { return {}; }
  static Resume none() { return {Kind::kNone, {}}; }
  static Resume from(std::string file) { return {Kind::kFile, std::move(file)}; }
  /// "auto", "none" or a file's path (the command line's --resume).
  static Resume parse(const std::string& text);
  std::string str() const;  // as parse() reads it
};

/// How the pipeline strategies cut the model's chain of blocks into stages.
struct Balance {
  enum class By {
    kTime,    // each block's forward and backward measured on a sample batch (the default)
    kSize,    // parameter bytes
    kLayers,  // blocks per stage as given
  };
  By by = By::kTime;
  std::vector<int> layers;  // kLayers: one count per stage, summing to the chain's length

  static Balance time() { return {}; }
  static Balance size() { return {By::kSize, {}}; }
  static Balance of(std::vector<int> layers) { return {By::kLayers, std::move(layers)}; }
  /// "auto" or "time", "size", or "N,M,..." (the command line's --balance); UsageError for
  /// anything else.
  static Balance parse(const std::string& text);
  std::string str() const;  // "time", "size" or "N,M,..."
};

/// The pipeline strategies' own options (pipeline: stages on this process's devices; grid:
/// stages on ranks). pipeline.h and dist_pipeline.h say what each does. A field is unset until a
/// program (or its flag) gives it. The pipeline strategies read the options through resolved(),
/// which puts each unset field at the default named beside it; validate() refuses a field given
/// to a strategy that has no pipeline, naming it. Nothing compares a value with its default to
/// guess whether it was given.
struct PipelineTrainOptions {
  std::optional<PipelineSchedule> schedule;  // unset: gpipe
  std::optional<int> chunks;          // micro-batches per batch; unset or 0: twice the stages
  std::optional<int64_t> split_size;  // pipeline: micro-batches of this many samples instead
                                      // (seed 000); unset or 0: by chunks
  std::optional<Balance> balance;     // unset: Balance::time()
  std::optional<PipelineCheckpoint> checkpoint;  // activation checkpointing; unset: never
  std::optional<int> stages;                     // grid: ranks per pipeline; unset: 2
  std::optional<int> stages_per_device;  // interleaved 1F1B: stages on each device (pipeline) or
                                         // rank (grid of one replica); a Balance::of list then
                                         // has that many times more entries; unset: 1

  /// Every field with its value or its default.
  struct Resolved {
    PipelineSchedule schedule = PipelineSchedule::kGPipe;
    int chunks = 0;  // 0: twice the stages
    int64_t split_size = 0;
    Balance balance;
    PipelineCheckpoint checkpoint = PipelineCheckpoint::kNever;
    int stages = 2;
    int stages_per_device = 1;
  };
  Resolved resolved() const;
  /// The fields given, by their TrainerOptions names ("TrainerOptions::pipeline.chunks"...), in
  /// the order above; `except` leaves those named out.
  std::vector<std::string> given(const std::vector<std::string>& except = {}) const;
};

/// Tensor parallelism within each replica (tensor_parallel.h), under ddp, zero1, zero2, fsdp
/// (the mesh {dp: world / size, tp: size}) and grid ({dp, pp, tp}): each replica's model (each
/// stage, in a grid) is split over `size` ranks by Model::parallelize.
struct TensorParallelTrainOptions {
  int size = 1;                    // ranks per tensor-parallel group; 1: no split
  bool sequence_parallel = false;  // size > 1: LayerNorms etc. on a sequence slice
};

/// Context parallelism within each replica (context_parallel.h), under ddp, zero1, zero2, fsdp
/// and grid, with or without tensor parallelism (the mesh {dp, cp, pp, tp}): each sequence of a
/// batch is cut over `size` ranks, which hold the same weights; the model (Model::context_parallel)
/// takes its rank's slice, its positions and ring attention over the group, the loss and its
/// targets are the slice's, and the gradients are averaged over dp · cp ranks. A loss is a mean
/// over the slice's targets: exactly the whole sequence's when every slice counts as many (no
/// ignored target, as in the text task).
struct ContextParallelTrainOptions {
  int size = 1;               // ranks per sequence; 1: none
  bool load_balanced = true;  // causal balance: each rank a head and a tail chunk (ContextSplit)
};

/// Expert parallelism (expert_parallel.h), under ddp, zero1, zero2 and fsdp: every MoE layer of the
/// model (moe_layers()) spreads its experts over blocks of `size` consecutive data-parallel ranks
/// (dp x cp flattened; ParallelDims::ep), each rank E / size of them; tokens travel to their
/// experts by all-to-all. The other weights are averaged (or sharded) over every data-parallel rank
/// as before, an expert's averaged over the ranks that hold it, whole on each. Checkpoints hold
/// every expert by its global index (the weights gathered over the group), so a run resumes at any
/// other degree.
struct ExpertParallelTrainOptions {
  int size = 1;  // ranks the experts are spread over; 1: every rank holds every expert
};

/// The options of train(): first those of every run, then each strategy's own (ddp, pipeline,
/// tensor_parallel). The pipeline's and the tensor-parallel ones are refused by the strategies
/// that do not take them; `ddp` applies wherever DDP runs (ddp, and the replicas of a grid and of
/// the tensor-parallel strategies) and is unused elsewhere, but for uneven_inputs, ddp's alone.
struct TrainerOptions {
  Strategy strategy = Strategy::kDDP;
  int epochs = 5;
  int64_t batch_size = 256;  // global: split over the ranks (ddp) or the data-parallel replicas
  int accumulate = 1;        // gradient accumulation: batches per optimizer step
  // Evaluation's batch per data-parallel replica. 0: the training batch per replica, as a
  // PyTorch loop evaluates with its loader's batch (a language model's logits grow with it:
  // batch x context x vocabulary).
  int64_t eval_batch_size = 0;
  uint64_t seed = 0;  // the weights' start; rank r draws dropout from rank_seed(seed, r / tp)
                      // (rng.h: a tensor-parallel group's ranks draw alike)
  std::string out_dir = "runs/latest";
  int checkpoint_every = 0;  // steps; 0: only at the end of each epoch
  int keep = 3;              // checkpoints kept
  CheckpointFormat checkpoint_format = CheckpointFormat::kDcp;  // the default: PyTorch's layout
  // Checkpoints written in the background (AsyncCheckpointer, checkpoint.h): the steps wait only
  // for a copy in memory; the file is on disk before the next checkpoint and before train()
  // returns. StepReport::checkpointed then means "taken, being written".
  bool async_checkpoint = false;
  // Fault-tolerant replicas (fault_tolerance.h): this train() is one replica of several, each
  // started on its own; batch_size is the replica's, and a step's batch is that times the live
  // replicas. ddp, zero1, zero2 or fsdp within a replica; each replica needs an out_dir of its
  // own.
  std::optional<ReplicaGroupOptions> fault_tolerant;
  Resume resume;            // where the run starts: Resume::automatic(), none() or from(file)
  bool overwrite = false;   // out_dir holds another run: delete its files and start afresh
                            // (without it, such a folder is refused unless resumed)
  int log_every = 50;       // steps between metric lines
  bool progress = true;     // progress bar / lines on rank 0
  bool tensorboard = true;  // events.out.tfevents.* in out_dir (rank 0)
  int workers = 1;          // loader threads per rank, 0 to 256 (0: on the training thread)
  // In-memory splits (DataSource::rows: Fashion-MNIST, synthetic, a user's in_memory() tensors)
  // held on this rank's device, each batch gathered there: no loader thread and no copy per
  // step (Note [Data on the device] in src/train/run_steps.cpp). The batches are the loader's.
  bool data_on_device = false;
  // ddp, grid, zero1, zero2, fsdp: this rank's device. Unset: cuda:<local rank> when GPUs are
  // visible, else the CPU. A CUDA device without an index is cuda:<local rank>.
  std::optional<c10::Device> device;
  // dp and pipeline: the devices, one per replica or stage (the CPU may repeat). Empty: every
  // GPU, else two CPU "devices".
  std::vector<c10::Device> devices;
  // > 0: before each optimizer step the gradients are scaled down to this global L2 norm where
  // it is larger (PyTorch's clip_grad_norm_), the norm over the whole model whichever rank holds
  // which part (shards, stages, slices). StepReport::grad_norm gives the norm before clipping.
  double max_grad_norm = 0;
  // Autocast under ddp (fp16 with loss scaling) and grid (bf16); under zero1, zero2 and fsdp,
  // kBf16 is the sharded policy (bf16 parameters over fp32 master shards, zero.h's param_dtype).
  Amp amp = Amp::kNone;
  bool channels_last = true;  // convolution weights and image batches in NHWC memory
  double timeout_s = 300;     // collective timeout of the process group (the tool's --timeout)
  // The peak FLOP/s of one device, for TrainResult::mfu (flops.h): the data sheet's dense figure
  // for the precision trained in. 0: unknown, so measured on the CPU (a short fp32 matmul per
  // rank before training), and on CUDA no MFU (never guessed).
  double peak_flops = 0;

  // ---- Each strategy's own ----
  // The data-parallel replicas' DDP (ddp.h): ddp, and grid's and the tensor-parallel strategies'
  // replicas. uneven_inputs: kFail within a step, naming the ranks, or kJoin (ddp only; kOff is
  // refused: the trainer always checks).
  DDPOptions ddp;
  PipelineTrainOptions pipeline;                 // pipeline and grid
  TensorParallelTrainOptions tensor_parallel;    // ddp, zero1, zero2, fsdp and grid
  ContextParallelTrainOptions context_parallel;  // ddp, zero1, zero2, fsdp and grid
  ExpertParallelTrainOptions expert_parallel;    // ddp, zero1, zero2 and fsdp
};

/// The parallel degrees `options` stand for (parallel_dims.h), data parallelism the rest of the
/// world: ddp {dp_replicate -1, tp}, zero1/zero2/fsdp {dp_shard -1, zero_stage 1/2/3, tp}, grid
/// {dp_replicate -1, pp = pipeline.stages, tp}, dp and pipeline all 1 (one process), with tp =
/// tensor_parallel.size, cp = context_parallel.size and ep = expert_parallel.size.
/// `.resolve(world)` gives a job's degrees; options validate() refuses may make it throw.
ParallelDims parallel_dims(const TrainerOptions& options);

/// Checks the options of a task against the world before any work: the strategy's combinations
/// (dp and pipeline in one process, a grid's world a multiple of its stages, pipeline options
/// with a pipeline only...), the numbers, an unwritable output folder, a folder holding another
/// run that is neither resumed nor overwritten. Throws UsageError naming the value and the fix.
/// Writes nothing but the output folder itself.
void validate(const TrainerOptions& options, int world_size);

}  // namespace scaletrain
