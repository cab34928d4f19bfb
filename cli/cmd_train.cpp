// `scaletrain train`: trains a model of the zoo with DDP. Started by hand it launches itself
// over the local devices (every GPU, or 2 CPU processes); under `scaletrain run`, torchrun,
// srun or mpirun it is one rank of the job.

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <sstream>

#include "commands.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "scaletrain/launch.h"
#include "scaletrain/trainer.h"
#include "scaletrain/version.h"

namespace scaletrain::cli {
namespace {

bool inside_a_job() {
  for (const char* v : {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
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
  std::cout << std::fixed << std::setprecision(4) << "\nscaletrain train: " << o.model << " on "
            << o.dataset << ", " << d.size() << " process(es) (" << d.backend_name << ")\n"
            << "  test accuracy   " << r.test_accuracy << "\n"
            << std::setprecision(1) << "  time per epoch  " << per_epoch.str() << "\n"
            << "  throughput      " << std::setprecision(0) << r.samples_per_second
            << " samples/s\n"
            << "  device          " << r.device << ", peak memory " << std::setprecision(1)
            << static_cast<double>(r.peak_memory_bytes) / (1 << 20) << " MiB (rank 0)\n"
            << "  checkpoint      "
            << (!r.last_checkpoint.empty() && std::filesystem::exists(r.last_checkpoint)
                    ? r.last_checkpoint
                    : std::string("(none written)"))
            << "\n"
            << "  weights         " << r.weights_path << " (torch.load in Python)\n"
            << "  metrics         " << r.metrics_path
            << (o.tensorboard ? " (tensorboard --logdir " + o.out_dir + ")" : std::string())
            << std::endl;
}

}  // namespace

void add_train_command(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand(
      "train", "Train a model with DDP (default: LeNet on Fashion-MNIST over the local devices)");
  struct Args {
    TrainOptions o;
    std::string nproc = "auto";
    std::string backend = "auto";
  };
  auto args = std::make_shared<Args>();
  auto& o = args->o;
  cmd->add_option("--model", o.model, "toy, mlp, lenet, resnet18, resnet50 or resnet101")
      ->capture_default_str();
  cmd->add_option("--dataset", o.dataset,
                  "fashion-mnist, synthetic, or folder (ImageNet-style train/ and val/)")
      ->capture_default_str();
  cmd->add_option("--data-dir", o.data_dir,
                  "Folder of the IDX .gz files, or of train/ and val/ for --dataset folder")
      ->capture_default_str();
  cmd->add_option("--image-size", o.image_size, "Crop size of --dataset folder images")
      ->capture_default_str();
  cmd->add_option("--device", o.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--amp", o.amp, "Mixed precision: none, bf16 or fp16 (loss scaling)")
      ->capture_default_str();
  cmd->add_option("--workers", o.workers, "Loader threads per process")->capture_default_str();
  cmd->add_option("--init-weights", o.init_weights,
                  "Start from a state dict (e.g. Python's torch.save(model.state_dict()))");
  cmd->add_flag("!--no-tensorboard", o.tensorboard, "No TensorBoard event file");
  cmd->add_flag("!--no-channels-last", o.channels_last,
                "Keep convolution weights and batches in the default (NCHW) memory layout");
  cmd->add_option("--limit-train", o.limit_train, "Use only the first N training samples");
  cmd->add_option("--limit-test", o.limit_test, "Use only the first N test samples");
  cmd->add_option("--epochs", o.epochs)->capture_default_str();
  cmd->add_option("--batch-size", o.batch_size, "Global batch, split over the ranks")
      ->capture_default_str();
  cmd->add_option("--optimizer", o.optimizer, "sgd or adam")->capture_default_str();
  cmd->add_option("--lr", o.lr)->capture_default_str();
  cmd->add_option("--momentum", o.momentum)->capture_default_str();
  cmd->add_option("--weight-decay", o.weight_decay)->capture_default_str();
  cmd->add_option("--schedule", o.schedule, "none, step or cosine")->capture_default_str();
  cmd->add_option("--step-size", o.step_size, "Epochs between step-schedule decays");
  cmd->add_option("--gamma", o.gamma, "Step-schedule factor");
  cmd->add_option("--accumulate", o.accumulate, "Batches per optimizer step");
  cmd->add_option("--seed", o.seed)->capture_default_str();
  cmd->add_option("--out", o.out_dir, "Folder for checkpoints and metrics")->capture_default_str();
  cmd->add_option("--checkpoint-every", o.checkpoint_every,
                  "Steps between checkpoints (0: epochs)");
  cmd->add_option("--keep", o.keep, "Checkpoints kept")->capture_default_str();
  cmd->add_option("--resume", o.resume, "auto, none, or a checkpoint file")->capture_default_str();
  cmd->add_flag("--overwrite", o.overwrite,
                "--out holds another run: delete its checkpoints, metrics, event files, model.pt "
                "and run.json, and start afresh");
  cmd->add_option("--log-every", o.log_every, "Steps between metric lines")->capture_default_str();
  cmd->add_option("--nproc-per-node", args->nproc,
                  "Processes when started by hand: a number or auto (every GPU, else 2)")
      ->capture_default_str();
  cmd->add_option("--backend", args->backend, "gloo, nccl or auto")->capture_default_str();
  cmd->add_option("--timeout", o.timeout_s,
                  "Collective timeout in seconds: a rank waiting longer for the others in one "
                  "collective fails, naming it (300: room for a slow first step or a big "
                  "checkpoint; lower it to surface a lost rank sooner)")
      ->capture_default_str();
  cmd->add_option("--uneven-inputs", o.uneven_inputs,
                  "Ranks with different batch counts: fail (within a step, naming them) or join "
                  "(the others finish the epoch)")
      ->capture_default_str();
  cmd->add_flag("!--no-progress", o.progress, "No progress bar");
  cmd->callback([args, &action, cmd] {
    action = [args, cmd] {
      if (!inside_a_job()) {
        // Started by hand: become the launcher of this node's ranks.
        LaunchOptions lo;
        const bool gpus = cuda_device_count() > 0 && args->o.device != "cpu";
        lo.nproc_per_node = parse_nproc_per_node(args->nproc, gpus ? cuda_device_count() : 2);
        if (lo.nproc_per_node < 1) {
          throw UsageError("--nproc-per-node " + args->nproc +
                           " must be at least 1 (or 'auto': every GPU, else 2)");
        }
        validate(args->o, lo.nproc_per_node);
        lo.master_port = 0;
        lo.show_ranks = {0};  // rank 0 reports; the others' logs stay quiet
        std::error_code ec;
        lo.command = {std::filesystem::read_symlink("/proc/self/exe", ec).string()};
        for (size_t i = 1; i < program_args().size(); ++i) lo.command.push_back(program_args()[i]);
        scaletrain::validate(lo);
        const int status = launch(lo);
        if (status >= 128) {  // interrupted (the launcher said by which signal)
          auto last = newest_valid_checkpoint(args->o.out_dir);
          std::cerr << "scaletrain train: interrupted; "
                    << (last ? "the last checkpoint is " + *last +
                                   ": run the same command again to resume from it"
                             : "no checkpoint was written yet in " + args->o.out_dir +
                                   " (--overwrite starts afresh there)")
                    << std::endl;
        }
        return status;
      }
      InitOptions io;
      io.backend = args->backend;
      validate(args->o, 1);  // the numbers, before any rendezvous (the world is checked in train)
      io.timeout = std::chrono::milliseconds(static_cast<int64_t>(args->o.timeout_s * 1000));
      // CPU tensors need Gloo even where NCCL could be had.
      if (io.backend == "auto" && args->o.device == "cpu") io.backend = "gloo";
      Dist d = init_process_group(io);
      TrainResult r = train(args->o, d);
      if (d.rank() == 0) print_summary(args->o, r, d);
      return 0;
    };
  });
}

}  // namespace scaletrain::cli
