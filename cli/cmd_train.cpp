// `scaletrain train`: trains a model of the zoo with DDP. Started by hand it launches itself
// over the local devices (every GPU, else a process per CPU core, at most 8); under `scaletrain
// run`, torchrun, srun or mpirun it is one rank of the job.

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <optional>
#include <sstream>
#include <type_traits>

#include "commands.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "scaletrain/flops.h"
#include "scaletrain/launch.h"
#include "scaletrain/secret.h"
#include "scaletrain/trainer.h"
#include "scaletrain/version.h"
#include "scaletrain_zoo.h"

namespace scaletrain::cli {
namespace {

bool inside_a_job() {
  for (const char* v : {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

// The last checkpoint, and what the steps waited for the checkpoints.
std::string checkpoint_line(const TrainOptions& o, const TrainResult& r) {
  if (r.last_checkpoint.empty() || !std::filesystem::exists(r.last_checkpoint)) {
    return "(none written)";
  }
  std::ostringstream s;
  s << r.last_checkpoint << " (" << r.checkpoints << " written"
    << (o.async_checkpoint ? " in the background" : "") << "; the steps waited " << std::fixed
    << std::setprecision(2) << r.checkpoint_seconds << " s for them)";
  return s.str();
}

// The MFU line (flops.h): "" for a model that states no FLOPs.
std::string mfu_line(const TrainResult& r) {
  if (r.model_flops_per_second <= 0) return "";
  std::ostringstream line;
  line << "  MFU             ";
  if (r.mfu <= 0) {
    line << "unknown (model " << format_flops(r.model_flops_per_second)
         << "; give --peak-flops, a device's peak FLOP/s)\n";
    return line.str();
  }
  line << std::fixed << std::setprecision(1) << 100 * r.mfu << "% (model "
       << format_flops(r.model_flops_per_second) << " of a "
       << (r.peak_measured ? "measured " : "given ") << format_flops(r.peak_flops)
       << (r.peak_measured ? " fp32 matmul peak per rank)\n" : " peak per device)\n");
  return line.str();
}

void print_summary(const TrainOptions& o, const TrainResult& r, const Dist& d) {
  double mean = r.epoch_seconds.empty()
                    ? 0
                    : std::accumulate(r.epoch_seconds.begin(), r.epoch_seconds.end(), 0.0) /
                          static_cast<double>(r.epoch_seconds.size());
  std::ostringstream per_epoch;
  if (r.epoch_seconds.empty()) {
    per_epoch << "(no epoch run)";
  } else {
    per_epoch << std::fixed << std::setprecision(1) << mean << " s";
  }
  std::ostringstream devices;  // seed 002's max memory and seed 001's parameters per device
  devices << std::fixed << std::setprecision(1);
  for (const auto& dev : r.devices) {
    devices << "  device          " << dev.device << ": " << dev.parameters << " parameters, peak "
            << static_cast<double>(dev.peak_memory_bytes) / (1 << 20) << " MiB"
            << (dev.device == "cpu" ? " (the process's)" : "") << "\n";
  }
  std::cout << std::fixed << std::setprecision(4) << "\nscaletrain train: " << o.model << " on "
            << o.dataset << ", --strategy " << to_string(o.strategy)
            << (o.tensor_parallel.size > 1
                    ? " --tp " + std::to_string(o.tensor_parallel.size) +
                          (o.tensor_parallel.sequence_parallel ? " --sequence-parallel" : "")
                    : std::string())
            << ", " << d.size() << " process(es) (" << d.backend_name << ")\n"
            << "  test accuracy   " << r.test_accuracy << "\n"
            << (r.metrics.count("test_perplexity")
                    ? "  test perplexity " + std::to_string(r.metrics.at("test_perplexity")) + "\n"
                    : std::string())
            << std::setprecision(1) << "  time per epoch  " << per_epoch.str() << "\n"
            << "  throughput      " << std::setprecision(0) << r.samples_per_second << " samples/s"
            << (r.tokens_per_second > 0
                    ? ", " + std::to_string(std::llround(r.tokens_per_second)) + " tokens/s"
                    : std::string())
            << "\n"
            << mfu_line(r) << devices.str() << "  checkpoint      " << checkpoint_line(o, r) << "\n"
            << "  weights         " << r.weights_path << " (torch.load in Python)\n"
            << "  metrics         " << r.metrics_path
            << (o.tensorboard ? " (tensorboard --logdir " + o.out_dir + ")" : std::string())
            << std::endl;
}

struct Args {
  TrainOptions o;
  std::string nproc = "auto";
  std::string backend = "auto";
  std::string strategy = "ddp", devices;
  // The pipeline's flags, set only when given (PipelineTrainOptions: unset takes the default).
  std::optional<std::string> schedule, checkpointing, balance;
  std::string seed = "0";
  std::string checkpoint_format = "dcp";
  std::string amp = "none", uneven_inputs = "fail";
  std::string device = "auto", resume = "auto";  // typed in the options
  bool fault_tolerant = false;                   // --fault-tolerant and its flags
  std::string lighthouse;
  int replica_id = 0;
  double ft_timeout = 10;
};

// --seed: a whole number from 0 to 2^64 - 1 (a negative one used to wrap around silently).
uint64_t parse_seed(const std::string& text) {
  try {
    size_t used = 0;
    if (!text.empty() && text[0] != '-' && text[0] != '+') {
      const uint64_t v = std::stoull(text, &used);
      if (used == text.size()) return v;
    }
  } catch (const std::exception&) {
  }
  throw UsageError("--seed '" + text + "' is not a whole number from 0 to 18446744073709551615");
}

// --fault-tolerant: this run is one replica; its checkpoints go to --out/replica-<id>.
void apply_fault_tolerance_flags(Args& a) {
  if (!a.fault_tolerant) {
    if (!a.lighthouse.empty()) {
      throw UsageError("--lighthouse is for fault-tolerant replicas: add --fault-tolerant");
    }
    return;
  }
  if (a.lighthouse.empty()) {
    throw UsageError(
        "--fault-tolerant needs --lighthouse HOST:PORT (start one with scaletrain lighthouse)");
  }
  if (a.o.lr_schedule != "none") {
    throw UsageError("--fault-tolerant with --lr-schedule " + a.o.lr_schedule +
                     " is not supported yet; use --lr-schedule none");
  }
  if (!(a.ft_timeout > 0)) {
    throw UsageError("--ft-timeout " + std::to_string(a.ft_timeout) + " must be above 0 seconds");
  }
  if (user_secret().empty()) {  // before any worker starts (Note [Job secret])
    throw UsageError(
        "--fault-tolerant: the lighthouse hears only processes that prove the job's secret, and "
        "none was given: set SCALETRAIN_SECRET_FILE=PATH (the lighthouse's; made where missing) "
        "or SCALETRAIN_SECRET for this command (docs/resilience.md)");
  }
  ReplicaGroupOptions r;
  r.lighthouse = a.lighthouse;
  r.replica_id = a.replica_id;
  r.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.ft_timeout * 1000));
  // The replica's other ranks wait for rank 0's quorum under --timeout: the same bound for both.
  r.quorum_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.o.timeout_s * 1000));
  // Note [Replica settings]: what the trainer cannot read off the model and the optimizer (a
  // GPT's dropout is a function, not a module; the data set by its name).
  std::ostringstream settings;
  settings << "dropout=" << a.o.dropout << "|dataset=" << a.o.dataset
           << "|init_weights=" << (a.o.init_weights.empty() ? "none" : a.o.init_weights);
  r.fingerprint = settings.str();
  a.o.fault_tolerant = r;
  a.o.out_dir += "/replica-" + std::to_string(a.replica_id);
}

// The strategy's flags, from their names into the options.
void apply_strategy_flags(Args& a) {
  a.o.strategy = parse_strategy(a.strategy);
  a.o.amp = parse_amp(a.amp);
  if (a.uneven_inputs == "fail" || a.uneven_inputs == "join") {
    a.o.ddp.uneven_inputs = a.uneven_inputs == "join" ? UnevenInputs::kJoin : UnevenInputs::kFail;
  } else {
    throw UsageError("unknown --uneven-inputs '" + a.uneven_inputs + "'; use fail or join");
  }
  a.o.seed = parse_seed(a.seed);
  if (a.checkpoint_format == "full") {
    a.o.checkpoint_format = CheckpointFormat::kFull;
  } else if (a.checkpoint_format == "sharded") {
    a.o.checkpoint_format = CheckpointFormat::kSharded;
  } else if (a.checkpoint_format == "dcp") {
    a.o.checkpoint_format = CheckpointFormat::kDcp;
  } else {
    throw UsageError("unknown --checkpoint-format '" + a.checkpoint_format +
                     "'; use full (one file), sharded (a file per rank: zero1, zero2, fsdp) or "
                     "dcp (a folder in PyTorch's distributed checkpoint layout)");
  }
  a.o.devices.clear();
  std::stringstream list(a.devices);
  for (std::string d; std::getline(list, d, ',');) {
    try {
      a.o.devices.push_back(parse_device(d));
    } catch (const UsageError&) {
      throw UsageError("--devices '" + a.devices + "': '" + d +
                       "' is not a device; give e.g. cpu,cpu or cuda:0,cuda:1");
    }
  }
  if (a.device != "auto") {
    try {
      a.o.device = parse_device(a.device, "TrainerOptions::device");
    } catch (const UsageError& e) {  // the library's device is unset for auto
      throw UsageError(std::string(e.what()) + ", or auto (a GPU when there is one)");
    }
  }
  if (a.schedule == "none" || a.schedule == "step" || a.schedule == "cosine") {
    throw UsageError(
        "--schedule is a pipeline's (gpipe, 1f1b, interleaved or zb-h1); the learning-rate "
        "schedule is --lr-schedule " +
        *a.schedule);
  }
  if (a.schedule) a.o.pipeline.schedule = parse_schedule(*a.schedule);
  if (a.checkpointing) a.o.pipeline.checkpoint = parse_pipeline_checkpoint(*a.checkpointing);
  if (a.balance) a.o.pipeline.balance = Balance::parse(*a.balance);
  a.o.resume = Resume::parse(a.resume);
  apply_fault_tolerance_flags(a);
}

// A pipeline's own flags: each sets its field of PipelineTrainOptions only when given, so that
// the library can name a flag given to a strategy without a pipeline (nothing compares a value
// with its default).
void add_pipeline_flags(CLI::App* cmd, Args& a) {
  auto& p = a.o.pipeline;
  const auto text = [cmd](const char* flag, std::optional<std::string>& to, const char* help) {
    cmd->add_option_function<std::string>(
        flag, [&to](const std::string& v) { to = v; }, help);
  };
  const auto number = [cmd](const char* flag, auto& to, const char* help) {
    using T = typename std::decay_t<decltype(to)>::value_type;
    cmd->add_option_function<T>(
        flag, [&to](const T& v) { to = v; }, help);
  };
  text("--schedule", a.schedule,
       "Pipelines: gpipe (the default), 1f1b, interleaved (with --stages-per-device) or zb-h1 "
       "(zero bubble); the last two with --strategy pipeline, or grid of one replica");
  number("--stages-per-device", p.stages_per_device,
         "--schedule interleaved: stages on each device (pipeline) or process (grid); "
         "--balance then lists that many times more (default 1)");
  number("--chunks", p.chunks, "Pipelines: micro-batches per batch (default: twice the stages)");
  number("--split-size", p.split_size,
         "Pipeline: micro-batches of this many samples instead of --chunks (seed 000)");
  text("--balance", a.balance,
       "Pipelines: blocks per stage: auto or time (measured, the default), size, or N,M,...");
  text("--checkpoint-activations", a.checkpointing,
       "Pipeline, grid: recompute activations in backward: never (the default), except-last or "
       "always");
  number("--pipeline-stages", p.stages, "Grid: ranks per pipeline (default 2)");
}

// The model, its data and where it computes.
void add_model_flags(CLI::App* cmd, Args& a) {
  auto& o = a.o;
  cmd->add_option("--model", o.model,
                  "toy, mlp, lenet, resnet18, resnet50, resnet101, gpt-tiny, gpt2-small or "
                  "llama-tiny; a Hugging Face folder of a Llama (config.json and safetensors, "
                  "docs/llama.md); or FILE.pt, a TorchScript module saved by Python "
                  "(docs/python_models.md)")
      ->capture_default_str();
  cmd->add_option("--dataset", o.dataset,
                  "fashion-mnist, synthetic, folder (ImageNet-style train/ and val/), or text "
                  "(train.bin and val.bin of token ids, for a GPT)")
      ->capture_default_str();
  cmd->add_option("--data-dir", o.data_dir,
                  "Folder of the IDX .gz files, of train/ and val/ for --dataset folder, or of "
                  "train.bin and val.bin for --dataset text")
      ->capture_default_str();
  cmd->add_option("--image-size", o.image_size, "Crop size of --dataset folder images")
      ->capture_default_str();
  cmd->add_option("--device", a.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--peak-flops", o.peak_flops,
                  "One device's peak FLOP/s for the MFU in the summary, e.g. 989e12 (0: measured "
                  "by a short fp32 matmul on the CPU; unknown on CUDA)")
      ->capture_default_str();
  cmd->add_option("--amp", a.amp,
                  "Mixed precision: none, bf16 or fp16 (loss scaling; ddp). grid: bf16 autocast. "
                  "zero1, zero2, fsdp: bf16 parameters over fp32 master shards")
      ->capture_default_str();
  cmd->add_option("--workers", o.workers, "Loader threads per process, 0 to 256 (0: none)")
      ->capture_default_str();
  cmd->add_flag("--data-on-device", o.data_on_device,
                "Hold fashion-mnist or synthetic on the training device and gather each batch "
                "there (no loader threads, no copy per step; the same batches)");
  cmd->add_option("--init-weights", o.init_weights,
                  "Start from a state dict: a file (safetensors, or Python's "
                  "torch.save(dict(model.state_dict()))) or a folder of dcp.save "
                  "(torch.distributed.checkpoint)");
  cmd->add_flag("!--no-tensorboard", o.tensorboard, "No TensorBoard event file");
  cmd->add_flag("!--no-channels-last", o.channels_last,
                "Keep convolution weights and batches in the default (NCHW) memory layout");
  cmd->add_option("--limit-train", o.limit_train, "Use only the first N training samples");
  cmd->add_option("--limit-test", o.limit_test, "Use only the first N test samples");
}

// The optimizer and the schedule of its learning rate.
void add_optimizer_flags(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--epochs", o.epochs)->capture_default_str();
  cmd->add_option("--batch-size", o.batch_size, "Global batch, split over the ranks")
      ->capture_default_str();
  cmd->add_option("--eval-batch-size", o.eval_batch_size,
                  "Evaluation's batch per replica (0: the training batch per replica)")
      ->capture_default_str();
  cmd->add_option("--optimizer", o.optimizer, "sgd or adam")->capture_default_str();
  cmd->add_option("--lr", o.lr)->capture_default_str();
  cmd->add_option("--momentum", o.momentum)->capture_default_str();
  cmd->add_option("--weight-decay", o.weight_decay)->capture_default_str();
  cmd->add_option("--lr-schedule", o.lr_schedule, "Learning-rate schedule: none, step or cosine")
      ->capture_default_str();
  cmd->add_option("--step-size", o.step_size, "Epochs between step-schedule decays");
  cmd->add_option("--gamma", o.gamma, "Step-schedule factor");
}

// The parallel strategy and its pipeline's shape.
void add_strategy_flags(CLI::App* cmd, Args& a) {
  cmd->add_option(
         "--strategy", a.strategy,
         "ddp (a process per device), dp (DataParallel over --devices), pipeline (the "
         "model's blocks over --devices), grid (a pipeline of --pipeline-stages ranks, "
         "replicated over the rest), zero1, zero2, fsdp (a process per device, sharding the "
         "optimizer state; and the gradients; and the parameters too)")
      ->capture_default_str();
  cmd->add_option("--devices", a.devices,
                  "dp and pipeline: the devices, e.g. cpu,cpu or cuda:0,cuda:1 (default: every "
                  "GPU, else cpu,cpu)");
  add_pipeline_flags(cmd, a);
  cmd->add_option(
         "--tp", a.o.tensor_parallel.size,
         "ddp, zero1, zero2, fsdp, grid: ranks per tensor-parallel group, each splitting one "
         "replica's model (grid: one stage's; gpt-tiny: its 256 tokens split, gpt2-small's "
         "50257 need --vocab-size 50304); the rest of the world is data parallel")
      ->capture_default_str();
  cmd->add_flag("--sequence-parallel", a.o.tensor_parallel.sequence_parallel,
                "With --tp: LayerNorms, dropout and residuals on a slice of the sequence");
}

// Steps, seed, and what the run writes: checkpoints, metrics.
void add_run_flags(CLI::App* cmd, Args& a) {
  auto& o = a.o;
  cmd->add_option("--accumulate", o.accumulate, "Batches per optimizer step");
  cmd->add_option("--max-grad-norm", o.max_grad_norm,
                  "Clip the gradients to this global L2 norm before each step (0: no clipping)")
      ->capture_default_str();
  cmd->add_option("--seed", a.seed,
                  "Seed of the weights and the data order (each rank's dropout draws from a "
                  "stream of its own, shared by a tensor-parallel group's ranks)")
      ->capture_default_str();
  cmd->add_option("--context", o.context,
                  "GPTs: the longest sequence and the text windows' length (0: the model's own, "
                  "gpt-tiny 64, gpt2-small 1024)")
      ->capture_default_str();
  cmd->add_option("--vocab-size", o.vocab_size,
                  "GPTs: the vocabulary's rows (0: the model's own, gpt-tiny 256, gpt2-small "
                  "50257); a larger one pads it, e.g. 50304 so that --tp divides it")
      ->capture_default_str();
  cmd->add_option("--dropout", o.dropout,
                  "mlp, GPTs: the probability of its dropout (GPTs: attention and residual; "
                  "with --tp the masks are the unsplit model's)")
      ->capture_default_str();
  cmd->add_flag("--checkpoint-blocks", o.checkpoint_blocks,
                "GPT, any strategy: recompute each transformer block in backward instead of "
                "keeping its activations");
  cmd->add_option("--out", o.out_dir, "Folder for checkpoints and metrics")->capture_default_str();
  cmd->add_option("--checkpoint-every", o.checkpoint_every,
                  "Steps between checkpoints (0: epochs)");
  cmd->add_option("--keep", o.keep, "Checkpoints kept")->capture_default_str();
  cmd->add_option("--checkpoint-format", a.checkpoint_format,
                  "dcp (gathered to rank 0, a folder in PyTorch's distributed checkpoint layout, "
                  "which Python's torch.distributed.checkpoint reads), full (one file, gathered "
                  "to rank 0) or sharded (zero1, zero2, fsdp: each rank writes its shard; "
                  "resumes at any world size)")
      ->capture_default_str();
  cmd->add_flag("--async-checkpoint", o.async_checkpoint,
                "Write checkpoints in the background: the steps wait only for a copy in memory");
  cmd->add_option("--resume", a.resume, "auto, none, or a checkpoint file")->capture_default_str();
  cmd->add_flag("--overwrite", o.overwrite,
                "--out holds another run: delete its checkpoints, metrics, event files, model.pt "
                "and run.json, and start afresh");
  cmd->add_option("--log-every", o.log_every, "Steps between metric lines")->capture_default_str();
}

// Fault-tolerant replicas (fault_tolerance.h).
void add_fault_tolerance_flags(CLI::App* cmd, Args& a) {
  cmd->add_flag("--fault-tolerant", a.fault_tolerant,
                "This job is one replica of several (ddp within it): a replica that fails is "
                "left out at the next step and the others go on; restarted, it takes the live "
                "state from a peer. --batch-size is the replica's");
  cmd->add_option("--lighthouse", a.lighthouse,
                  "--fault-tolerant: HOST:PORT of the lighthouse (scaletrain lighthouse) that "
                  "forms the replicas' quorum every step");
  cmd->add_option("--replica-id", a.replica_id,
                  "--fault-tolerant: this replica's number (0, 1, ...); its checkpoints go to "
                  "--out/replica-<id>")
      ->capture_default_str();
  cmd->add_option("--ft-timeout", a.ft_timeout,
                  "--fault-tolerant: seconds an exchange between replicas may wait before the "
                  "silent one is left out")
      ->capture_default_str();
}

// The processes: how many, how they talk, how long they wait for one another.
void add_process_flags(CLI::App* cmd, Args& a) {
  auto& o = a.o;
  cmd->add_option("--nproc-per-node", a.nproc,
                  "Processes when started by hand: a number or auto (one per GPU, else one per "
                  "CPU core, at most 8; as scaletrain run)")
      ->capture_default_str();
  cmd->add_option("--backend", a.backend, "gloo, nccl or auto")->capture_default_str();
  cmd->add_option("--timeout", o.timeout_s,
                  "Collective timeout in seconds: a rank waiting longer for the others in one "
                  "collective fails, naming it (300: room for a slow first step or a big "
                  "checkpoint; lower it to surface a lost rank sooner)")
      ->capture_default_str();
  cmd->add_option("--uneven-inputs", a.uneven_inputs,
                  "Ranks with different batch counts: fail (within a step, naming them) or join "
                  "(the others finish the epoch)")
      ->capture_default_str();
  cmd->add_flag("!--no-progress", o.progress, "No progress bar");
}

// Each rank's process group: CPU tensors need Gloo even where NCCL could be had.
InitOptions init_options(const Args& a) {
  InitOptions io;
  io.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.o.timeout_s * 1000));
  io.backend = train_backend(a.o, a.backend, cuda_device_count());
  return io;
}

// Started by hand: become the launcher of this node's ranks.
int launch_ranks(Args& a) {
  LaunchOptions lo;
  const bool gpus = cuda_device_count() > 0 && !(a.o.device && a.o.device->is_cpu());
  const auto s = a.o.strategy;
  const bool per_device =
      s == Strategy::kDDP || s == Strategy::kZero1 || s == Strategy::kZero2 || s == Strategy::kFsdp;
  const int automatic = s == Strategy::kGrid ? std::max(parallel_dims(a.o).model_ranks(), 1)
                        : per_device ? (gpus ? cuda_device_count() : auto_nproc_per_node(false))
                                     : 1;  // dp, pipeline: one process
  lo.nproc_per_node = parse_nproc_per_node(a.nproc, automatic);
  if (lo.nproc_per_node < 1) {
    throw UsageError(
        "--nproc-per-node " + a.nproc +
        " must be at least 1 (or 'auto': one per GPU, else one per CPU core, at most 8)");
  }
  require_free_output_folder(a.o);  // a live run there is the first thing to say
  validate(a.o, lo.nproc_per_node);
  // Regression (BackendDeviceAndDataDirWereFoundInTheWorkers): a backend no rank can join
  // failed in every rank, after they had been started.
  scaletrain::validate(init_options(a));
  lo.master_port = 0;
  lo.show_ranks = {0};  // rank 0 reports; the others' logs stay quiet
  std::error_code ec;
  lo.command = {std::filesystem::read_symlink("/proc/self/exe", ec).string()};
  for (size_t i = 1; i < program_args().size(); ++i) lo.command.push_back(program_args()[i]);
  scaletrain::validate(lo);
  const int status = launch(lo);
  if (status >= 128) {  // interrupted (the launcher said by which signal)
    auto last = newest_valid_checkpoint(a.o.out_dir);
    std::cerr << "scaletrain train: interrupted; "
              << (last ? "the last checkpoint is " + *last +
                             ": run the same command again to resume from it"
                       : "no checkpoint was written yet in " + a.o.out_dir +
                             " (--overwrite starts afresh there)")
              << std::endl;
  }
  return status;
}

// One rank of a job: join the process group, train, and report on rank 0.
int train_rank(Args& a) {
  validate(a.o, discover_world().world_size);  // before any rendezvous
  Dist d = init_process_group(init_options(a));
  TrainResult r = train(a.o, d);
  if (d.rank() == 0 && !r.left_behind) print_summary(a.o, r, d);
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("train", kTrainDescription);
  auto args = std::make_shared<Args>();
  add_model_flags(cmd, *args);
  add_optimizer_flags(cmd, args->o);
  add_strategy_flags(cmd, *args);
  add_run_flags(cmd, *args);
  add_process_flags(cmd, *args);
  add_fault_tolerance_flags(cmd, *args);
  // The library's names of the options these flags set: its messages name them, and the command
  // line's user reads the flags instead (in_flag_names). A flag named here that the functions
  // above do not define is an error at start-up.
  name_flags(*cmd, {{"TrainerOptions::accumulate", "--accumulate"},
                    {"TrainerOptions::amp", "--amp"},
                    {"TrainerOptions::async_checkpoint", "--async-checkpoint"},
                    {"TrainerOptions::pipeline.balance", "--balance"},
                    {"TrainerOptions::batch_size", "--batch-size"},
                    {"TrainerOptions::checkpoint_every", "--checkpoint-every"},
                    {"TrainerOptions::checkpoint_format", "--checkpoint-format"},
                    {"TrainerOptions::pipeline.checkpoint", "--checkpoint-activations"},
                    {"TrainerOptions::pipeline.chunks", "--chunks"},
                    {"TrainerOptions::data_on_device", "--data-on-device"},
                    {"TrainerOptions::device", "--device"},
                    {"TrainerOptions::devices", "--devices"},
                    {"TrainerOptions::epochs", "--epochs"},
                    {"TrainerOptions::eval_batch_size", "--eval-batch-size"},
                    {"TrainerOptions::fault_tolerant", "--fault-tolerant"},
                    {"TrainerOptions::keep", "--keep"},
                    {"TrainerOptions::log_every", "--log-every"},
                    {"TrainerOptions::max_grad_norm", "--max-grad-norm"},
                    {"TrainerOptions::out_dir", "--out"},
                    {"TrainerOptions::overwrite", "--overwrite"},
                    {"TrainerOptions::peak_flops", "--peak-flops"},
                    {"TrainerOptions::pipeline.stages", "--pipeline-stages"},
                    {"TrainerOptions::resume", "--resume"},
                    {"TrainerOptions::pipeline.schedule", "--schedule"},
                    {"TrainerOptions::tensor_parallel.sequence_parallel", "--sequence-parallel"},
                    {"TrainerOptions::pipeline.split_size", "--split-size"},
                    {"TrainerOptions::pipeline.stages_per_device", "--stages-per-device"},
                    {"TrainerOptions::strategy", "--strategy"},
                    {"TrainerOptions::tensor_parallel.size", "--tp"},
                    {"TrainerOptions::timeout_s", "--timeout"},
                    {"TrainerOptions::ddp.uneven_inputs", "--uneven-inputs"},
                    {"TrainerOptions::workers", "--workers"},
                    {"ReplicaGroupOptions::lighthouse", "--lighthouse"},
                    {"ReplicaGroupOptions::replica_id", "--replica-id"},
                    {"TokenWindowOptions::vocab_size", "--vocab-size"}});
  cmd->callback([args, &action] {
    action = [args] {
      apply_strategy_flags(*args);
      return inside_a_job() ? train_rank(*args) : launch_ranks(*args);
    };
  });
}

}  // namespace scaletrain::cli
