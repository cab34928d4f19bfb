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
#include "train_flags.h"

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
            << (o.context_parallel.size > 1 ? " --cp " + std::to_string(o.context_parallel.size)
                                            : std::string())
            << (o.expert_parallel.size > 1 ? " --ep " + std::to_string(o.expert_parallel.size)
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
  const ParallelDims dims = parallel_dims(a.o);  // a grid: one replica's ranks, times cp
  const int automatic = s == Strategy::kGrid ? std::max(dims.model_ranks() * dims.cp, 1)
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
                    {"TrainerOptions::context_parallel.size", "--cp"},
                    {"TrainerOptions::context_parallel.load_balanced", "--cp-in-order"},
                    {"TrainerOptions::expert_parallel.size", "--ep"},
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
