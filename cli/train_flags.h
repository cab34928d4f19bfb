#pragma once
// `scaletrain train`'s flags (internal to cli/): what they hold, and their definitions by group
// (train_flags.cpp); cmd_train.cpp turns them into TrainOptions and runs.

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "scaletrain_zoo.h"

namespace scaletrain::cli {

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

// Each group of flags onto `cmd`, into `a` (their help says what each takes).
void add_model_flags(CLI::App* cmd, Args& a);
void add_optimizer_flags(CLI::App* cmd, TrainOptions& o);
void add_strategy_flags(CLI::App* cmd, Args& a);
void add_run_flags(CLI::App* cmd, Args& a);
void add_process_flags(CLI::App* cmd, Args& a);
void add_fault_tolerance_flags(CLI::App* cmd, Args& a);

}  // namespace scaletrain::cli
