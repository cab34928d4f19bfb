#pragma once
// Each subcommand of the `scaletrain` tool registers itself on the CLI11 app and leaves the
// action to run once parsing succeeded. Actions return the process exit status.
//
// Note [Front]: `scaletrain` is two programs. The front (front.cpp, built on the LibTorch-free
// base library only) runs `scaletrain run` itself, so that a launcher costs a few MB, and hands
// every other subcommand (and --version) to the full tool, `scaletrain-tool`, by execv with the
// same argv; the full tool (main.cpp) knows every subcommand. Both build their --help from the
// descriptions below, so `scaletrain --help` lists the same subcommands either way.

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace scaletrain::cli {

using Action = std::function<int()>;

inline constexpr const char* kRunDescription =
    "Start the workers of a program on this node, torchrun-style: "
    "scaletrain run [options] -- PROGRAM [ARGS...]";
inline constexpr const char* kTrainDescription =
    "Train a model of the zoo with ddp, dp, a pipeline or a grid (default: LeNet on "
    "Fashion-MNIST with DDP over the local devices)";
inline constexpr const char* kCheckDescription =
    "Join the process group (from torchrun/Slurm/MPI variables) and verify "
    "all-reduce, broadcast, barrier and DDP's gradient sum across every rank";
inline constexpr const char* kBenchDescription =
    "Rerun the seeds' experiments: raw CSV, JSON statistics, PNG plots and a report";
inline constexpr const char* kDataDescription =
    "Prepare a data set: `data text` tokenizes text into the token files a GPT trains on";
inline constexpr const char* kLighthouseDescription =
    "Serve the quorum of fault-tolerant replicas (scaletrain train --fault-tolerant "
    "--lighthouse HOST:PORT)";
inline constexpr const char* kBenchWorkerDescription = "";  // internal: one rank of a suite
inline constexpr const char* kVersionDescription =
    "Print scaletrain's and LibTorch's versions and exit";

struct SubcommandInfo {
  const char* name;
  const char* description;
};
/// The subcommands the full tool runs (all but `run`), in the order --help lists them.
inline constexpr SubcommandInfo kToolSubcommands[] = {
    {"train", kTrainDescription},           {"check", kCheckDescription},
    {"bench", kBenchDescription},           {"data", kDataDescription},
    {"lighthouse", kLighthouseDescription}, {"bench-worker", kBenchWorkerDescription}};

void add_run_command(CLI::App& app, Action& action);
void add_check_command(CLI::App& app, Action& action);
void add_bench_command(CLI::App& app, Action& action);
void add_train_command(CLI::App& app, Action& action);
void add_data_command(CLI::App& app, Action& action);
void add_lighthouse_command(CLI::App& app, Action& action);

/// The app both programs start from: name, description, footer, argparse's repeated options.
void configure_app(CLI::App& app);

/// Parses argv with the registered subcommands and runs the chosen action. Exit status: 0
/// success, 1 failure of the job, 2 bad input (an unknown subcommand or flag, named), 128+N when
/// stopped by signal N.
int parse_and_run(CLI::App& app, const Action& action, int argc, char** argv);
/// Records which of `cmd`'s flags sets each of the library's options named in `fields`
/// ({"TrainerOptions::batch_size", "--batch-size"}), for in_flag_names(). Throws CLI11's error
/// for a flag `cmd` does not define.
void name_flags(const CLI::App& cmd,
                const std::vector<std::pair<std::string, std::string>>& fields);
/// The library's option names in an error message (TrainerOptions::batch_size) as the flags
/// that set them (--batch-size), for the options name_flags() recorded; other text unchanged.
std::string in_flag_names(const std::string& message);

/// The tool's own command line (argv), for subcommands that start themselves again.
const std::vector<std::string>& program_args();

/// A --nproc-per-node value: a whole number (validated later against the machine), or "auto"
/// for `auto_value`. Throws UsageError naming the value otherwise.
int parse_nproc_per_node(const std::string& value, int auto_value);

}  // namespace scaletrain::cli
