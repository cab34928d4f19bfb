#include "train/validation.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "scaletrain/loader.h"
#include "scaletrain/version.h"
#include "train/run_folder.h"

namespace scaletrain {

namespace fs = std::filesystem;

void validate_trainer_numbers(const TrainerOptions& o) {
  require(o.timeout_s > 0 && std::isfinite(o.timeout_s), "TrainerOptions::timeout_s", o.timeout_s,
          "a positive number of seconds");
  require(o.epochs >= 1, "TrainerOptions::epochs", int64_t{o.epochs}, "at least 1");
  require(o.accumulate >= 1, "TrainerOptions::accumulate", int64_t{o.accumulate},
          "at least 1 (batches per step)");
  require(o.keep >= 1, "TrainerOptions::keep", int64_t{o.keep},
          "at least 1: the newest checkpoint is what a resume starts from");
  require(o.checkpoint_every >= 0, "TrainerOptions::checkpoint_every", int64_t{o.checkpoint_every},
          "0 (at the end of each epoch) or more steps");
  require(o.log_every >= 0, "TrainerOptions::log_every", int64_t{o.log_every},
          "0 (no step lines) or more");
  // Regression (WorkersOfAHundredThousandAbortedBothRanks): every rank started threads until the
  // system refused one, and aborted.
  static_assert(kMaxLoaderWorkers == 256, "the message below names the limit");
  require(o.workers >= 0 && o.workers <= kMaxLoaderWorkers, "TrainerOptions::workers",
          int64_t{o.workers},
          "from 0 (load on the training thread) to 256 loader threads per rank, e.g. 1 to 8");
  const auto pipe = o.pipeline.resolved();
  require(pipe.chunks >= 0, "TrainerOptions::pipeline.chunks", int64_t{pipe.chunks},
          "1 or more (0: twice the stages)");
  require(pipe.split_size >= 0, "TrainerOptions::pipeline.split_size", pipe.split_size,
          "1 or more samples (0: TrainerOptions::pipeline.chunks)");
  if (o.device && !o.device->is_cpu() && !o.device->is_cuda()) {
    throw UsageError("TrainerOptions::device " + o.device->str() +
                     " is neither the CPU nor a CUDA device; use cpu, cuda or cuda:N");
  }
  if (o.ddp.uneven_inputs == UnevenInputs::kOff) {
    throw UsageError(
        "TrainerOptions::ddp.uneven_inputs kOff is DDP's own: the trainer checks every step; use "
        "kFail or kJoin");
  }
  require(o.peak_flops >= 0 && std::isfinite(o.peak_flops), "TrainerOptions::peak_flops",
          o.peak_flops, "0 (unknown: measured on the CPU) or a device's peak FLOP/s, e.g. 989e12");
  require(o.max_grad_norm >= 0 && std::isfinite(o.max_grad_norm), "TrainerOptions::max_grad_norm",
          o.max_grad_norm, "0 (no clipping) or a positive norm");
  if (o.max_grad_norm > 0 && o.amp == Amp::kFp16) {
    throw UsageError(
        "TrainerOptions::max_grad_norm with TrainerOptions::amp fp16 is not supported yet (the "
        "loss scale is "
        "in the gradients); use TrainerOptions::amp bf16 or none");
  }
}

namespace {

// The data-parallel replicas of a strategy in a world: how the global batch is split (called
// once the world is known to divide by the other degrees).
int replicas(const TrainerOptions& o, int world) { return parallel_dims(o).resolve(world).dp(); }

void refuse(const std::string& what) { throw UsageError(what); }

// dp's and a pipeline's devices exist here, before any tensor goes there (CUDA's own error is a
// backtrace).
void validate_devices(const TrainerOptions& o) {
  const int gpus = cuda_device_count();
  // Regression (BackendDeviceAndDataDirWereFoundInTheWorkers): a GPU this machine lacks failed
  // in every rank, after the launcher had started them, instead of here.
  if (o.device && o.device->is_cuda() && std::max<int>(o.device->index(), 0) >= gpus) {
    refuse("TrainerOptions::device " + o.device->str() + ": this machine has " +
           (gpus == 0 ? std::string("no GPU that CUDA can see; use cpu")
                      : std::to_string(gpus) +
                            " GPU(s); use cuda (each rank its own) or cuda:0 "
                            "to cuda:" +
                            std::to_string(gpus - 1)));
  }
  for (const auto& dev : o.devices) {
    if (!dev.is_cpu() && !dev.is_cuda()) {
      refuse("TrainerOptions::devices lists " + dev.str() +
             ", which is neither the CPU nor a CUDA device (cpu,cpu runs anywhere)");
    }
    if (!dev.is_cuda()) continue;
    const int index = std::max<int>(dev.index(), 0);
    if (index >= gpus) {
      refuse("TrainerOptions::devices lists " + dev.str() + ", and this machine has " +
             (gpus == 0
                  ? std::string("no GPU that CUDA can see")
                  : std::to_string(gpus) + " GPU(s), cuda:0 to cuda:" + std::to_string(gpus - 1)) +
             ": list devices it has (cpu,cpu runs anywhere)");
    }
  }
}

}  // namespace

namespace {

// "a", "a and b", "a, b and c".
std::string in_words(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  }
  return out;
}

// Which family a strategy is of: what its options may hold.
struct Family {
  explicit Family(Strategy s)
      : name(to_string(s)),
        ddp(s == Strategy::kDDP),
        dp(s == Strategy::kDataParallel),
        pipeline(s == Strategy::kPipeline),
        grid(s == Strategy::kGrid),
        zero(s == Strategy::kZero1 || s == Strategy::kZero2 || s == Strategy::kFsdp) {}
  std::string name;
  bool ddp, dp, pipeline, grid, zero;
};

// The processes and devices the strategy runs on.
void validate_placement(const TrainerOptions& o, const Family& f, int world) {
  if ((f.dp || f.pipeline) && world != 1) {
    refuse("TrainerOptions::strategy " + f.name +
           " runs in one process (its devices are threads of it), and " + std::to_string(world) +
           " processes were started: start one process, or train with ddp or grid "
           "across processes");
  }
  if ((f.ddp || f.grid || f.zero) && !o.devices.empty()) {
    refuse("TrainerOptions::devices is for dp and pipeline; TrainerOptions::strategy " + f.name +
           " runs one device per process (TrainerOptions::device)");
  }
  validate_devices(o);
  if (f.pipeline && !o.devices.empty() && o.devices.size() < 2) {
    refuse(
        "TrainerOptions::strategy pipeline needs at least 2 TrainerOptions::devices (cpu,cpu "
        "works), got 1");
  }
}

// Options that belong to some strategies only: pipeline options, --amp, --uneven-inputs, the
// sharded checkpoint format.
void validate_strategy_options(const TrainerOptions& o, const Family& f) {
  // The fields given, by name (PipelineTrainOptions::given(); pipeline.stages is the grid's
  // alone: validate_grid() names it).
  const auto given = o.pipeline.given({"stages"});
  if ((f.ddp || f.dp || f.zero) && !given.empty()) {
    refuse(in_words(given) + (given.size() == 1 ? " is" : " are") +
           " for the pipeline strategies (pipeline, grid), not TrainerOptions::strategy " + f.name);
  }
  if (f.zero && o.amp == Amp::kFp16) {
    refuse(
        "TrainerOptions::amp fp16 needs loss scaling, which the sharded strategies do not do; use "
        "TrainerOptions::amp bf16 "
        "(bf16 parameters over fp32 master shards) with TrainerOptions::strategy " +
        f.name);
  } else if (f.grid && o.amp == Amp::kFp16) {
    refuse(
        "TrainerOptions::amp fp16 needs one loss scale agreed over every stage, which the grid "
        "does not keep "
        "yet; use TrainerOptions::amp bf16 (bf16 has float32's range: no scaling) with "
        "TrainerOptions::strategy grid");
  } else if (!f.ddp && !f.zero && !f.grid && o.amp != Amp::kNone) {
    refuse("TrainerOptions::amp " + to_string(o.amp) +
           " runs with TrainerOptions::strategy ddp (autocast), grid (bf16 autocast) and zero1, "
           "zero2, fsdp "
           "(bf16 parameters), not " +
           f.name +
           " (dp's replicas and a pipeline's stages run on threads of their own, which autocast "
           "does not reach yet)");
  }
  if (!f.ddp && o.ddp.uneven_inputs != UnevenInputs::kFail)
    refuse("TrainerOptions::ddp.uneven_inputs is for TrainerOptions::strategy ddp");
  if (o.ddp.uneven_inputs == UnevenInputs::kJoin && o.tensor_parallel.size > 1) {
    refuse(
        "TrainerOptions::ddp.uneven_inputs join with TrainerOptions::tensor_parallel.size is not "
        "supported yet; use fail");
  }
  if (!f.zero && o.checkpoint_format == CheckpointFormat::kSharded) {
    refuse(
        "TrainerOptions::checkpoint_format sharded is for the sharded strategies (zero1, zero2, "
        "fsdp), not " +
        f.name + "; its checkpoints are gathered (TrainerOptions::checkpoint_format dcp or full)");
  }
}

// --stages-per-device and the interleaved schedule, which go together.
void validate_interleaving(const TrainerOptions& o, const Family& f) {
  const auto p = o.pipeline.resolved();
  if (p.stages_per_device < 1) {
    refuse("TrainerOptions::pipeline.stages_per_device " + std::to_string(p.stages_per_device) +
           " must be at least 1");
  }
  if ((p.stages_per_device > 1) != (p.schedule == PipelineSchedule::kInterleaved1F1B)) {
    refuse(
        "TrainerOptions::pipeline.schedule interleaved and "
        "TrainerOptions::pipeline.stages_per_device go together: "
        "interleaved 1F1B "
        "needs at least 2 stages per device, and more than one stage per device is "
        "interleaving");
  }
  if (p.schedule != PipelineSchedule::kInterleaved1F1B) return;
  if (!f.pipeline && !f.grid) {
    refuse(
        "TrainerOptions::pipeline.schedule interleaved runs in the pipeline strategies (pipeline, "
        "grid), "
        "not " +
        f.name);
  }
  if (p.split_size > 0) {
    refuse(
        "TrainerOptions::pipeline.schedule interleaved takes TrainerOptions::pipeline.chunks (a "
        "multiple of the "
        "devices), not "
        "TrainerOptions::pipeline.split_size");
  }
  const auto devices = f.grid ? p.stages : static_cast<int>(o.devices.size());
  if (devices > 0 && p.chunks > 0 && p.chunks % devices != 0) {
    refuse(
        "TrainerOptions::pipeline.schedule interleaved runs micro-batches in rounds of one per "
        "device: "
        "TrainerOptions::pipeline.chunks " +
        std::to_string(p.chunks) + " on " + std::to_string(devices) +
        " devices; use a multiple of " + std::to_string(devices));
  }
}

// A grid's stages over the world; --pipeline-stages is the grid's alone.
void validate_grid(const TrainerOptions& o, const Family& f, int world) {
  if (!f.grid) {
    if (o.pipeline.stages)
      refuse("TrainerOptions::pipeline.stages is for TrainerOptions::strategy grid");
    return;
  }
  const auto p = o.pipeline.resolved();
  const int tp = std::max(o.tensor_parallel.size, 1);
  const int cp = std::max(o.context_parallel.size, 1);
  if (p.stages < 2 || world % (p.stages * tp * cp) != 0) {
    refuse(
        "TrainerOptions::strategy grid needs TrainerOptions::pipeline.stages of at least 2 "
        "dividing the world" +
        std::string(tp > 1 ? " with TrainerOptions::tensor_parallel.size " + std::to_string(tp)
                           : "") +
        std::string(cp > 1 ? " and TrainerOptions::context_parallel.size " + std::to_string(cp)
                           : "") +
        ": " + std::to_string(world) + " processes, " + std::to_string(p.stages) +
        " stages; e.g. 4 processes = 2 replicas x 2 stages" +
        (tp > 1 ? ", 8 = 2 replicas x 2 stages x tp 2" : ""));
  }
  if (world > p.stages * tp && (p.schedule == PipelineSchedule::kZeroBubbleH1 ||
                                p.schedule == PipelineSchedule::kInterleaved1F1B)) {
    refuse(std::string(p.schedule == PipelineSchedule::kZeroBubbleH1
                           ? "TrainerOptions::pipeline.schedule zb-h1"
                           : "TrainerOptions::pipeline.schedule interleaved") +
           " across processes runs one pipeline (as many processes as "
           "TrainerOptions::pipeline.stages" +
           (tp > 1 ? " times TrainerOptions::tensor_parallel.size" : "") + ", here " +
           std::to_string(p.stages * tp) + ", not " + std::to_string(world) +
           "): the replicas of a grid average their stages with DDP, which takes gpipe or "
           "1f1b");
  }
  if (p.split_size > 0) {
    refuse(
        "TrainerOptions::pipeline.split_size is for TrainerOptions::strategy pipeline; a grid's "
        "stages take "
        "TrainerOptions::pipeline.chunks");
  }
}

// A --balance list gives one number per stage.
void validate_balance(const TrainerOptions& o, const Family& f) {
  if (!f.pipeline && !f.grid) return;
  const auto p = o.pipeline.resolved();
  const auto stages = (f.grid ? static_cast<size_t>(p.stages)
                              : (o.devices.empty() ? size_t{2} : o.devices.size())) *
                      static_cast<size_t>(std::max(p.stages_per_device, 1));
  const auto& b = p.balance;
  if (b.by != Balance::By::kLayers) return;
  for (int n : b.layers) {
    if (n < 1) {
      refuse("TrainerOptions::pipeline.balance '" + b.str() + "' has a stage of " +
             std::to_string(n) + " blocks; every stage needs at least 1");
    }
  }
  if (b.layers.size() != stages) {
    refuse("TrainerOptions::pipeline.balance '" + b.str() + "' gives " +
           std::to_string(b.layers.size()) + " stages; the pipeline has " + std::to_string(stages) +
           " (give auto, time, size or N,M,...)");
  }
}

}  // namespace

// Fault-tolerant replicas (Note [Fault-tolerant loop] in fault_loop.cpp): ddp within each
// replica, one optimizer step per batch, the gradients' plain average.
void validate_fault_tolerance(const TrainerOptions& o) {
  if (!o.fault_tolerant) return;
  const std::string what = "TrainerOptions::fault_tolerant";
  const Strategy s = o.strategy;
  if (s != Strategy::kDDP && s != Strategy::kZero1 && s != Strategy::kZero2 &&
      s != Strategy::kFsdp) {
    refuse(what +
           " runs TrainerOptions::strategy ddp, zero1, zero2 or fsdp within each replica (not " +
           to_string(s) + ")");
  }
  if (o.accumulate != 1)
    refuse(what + " takes one batch per step: leave TrainerOptions::accumulate at 1");
  if (o.amp == Amp::kFp16)
    refuse(what +
           " with TrainerOptions::amp fp16 is not supported; use TrainerOptions::amp bf16 or none");
  if (o.tensor_parallel.size > 1)
    refuse(what + " with TrainerOptions::tensor_parallel.size is not supported yet");
  if (o.checkpoint_format == CheckpointFormat::kSharded) {
    refuse(what +
           " writes gathered checkpoints: TrainerOptions::checkpoint_format dcp (the default) "
           "or full, not sharded");
  }
  parse_host_port(o.fault_tolerant->lighthouse, "ReplicaGroupOptions::lighthouse");
  if (o.fault_tolerant->replica_id < 0) {
    refuse("ReplicaGroupOptions::replica_id " + std::to_string(o.fault_tolerant->replica_id) +
           " must be 0 or more");
  }
}

void validate_strategy(const TrainerOptions& o, int world) {
  validate_fault_tolerance(o);
  const Family f(o.strategy);
  validate_placement(o, f, world);
  validate_strategy_options(o, f);
  validate_interleaving(o, f);
  validate_grid(o, f, world);
  validate_balance(o, f);
  if (o.eval_batch_size < 0) {
    refuse("TrainerOptions::eval_batch_size " + std::to_string(o.eval_batch_size) +
           " must be 0 (the training batch per replica) or more");
  }
  const int n = replicas(o, world);
  if (o.batch_size < n || o.batch_size % n != 0) {
    refuse("TrainerOptions::batch_size " + std::to_string(o.batch_size) +
           " does not split evenly over the " + std::to_string(n) +
           " data-parallel replica(s) of TrainerOptions::strategy " + f.name +
           "; use a multiple of " + std::to_string(n));
  }
}

void validate_output(const TrainerOptions& o) {
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  const std::string probe = o.out_dir + "/.writable";
  if (ec || !std::ofstream(probe)) {
    throw UsageError("the output folder '" + o.out_dir +
                     "' is not writable; choose another with TrainerOptions::out_dir");
  }
  fs::remove(probe, ec);
  if (o.resume.kind == Resume::Kind::kFile && !fs::exists(o.resume.file)) {
    throw UsageError("TrainerOptions::resume '" + o.resume.file +
                     "': no such checkpoint (use auto, none or a file)");
  }
  plan_run_start(o);  // refuses a folder of another run (Note [Run identity])
}

}  // namespace scaletrain
