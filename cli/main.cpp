// `scaletrain-tool`, the full `scaletrain` tool on LibTorch: every subcommand. Users start it
// through the front, `scaletrain` (Note [Front] in commands.h), which execs it with its own argv.

#include "commands.h"
#include "scaletrain/log.h"
#include "scaletrain/runtime.h"
#include "scaletrain/version.h"

int main(int argc, char** argv) {
  using namespace scaletrain;
  tune_cpu_allocator();
  // The library's lines on the console, its option names shown as this tool's flags.
  set_log_sink([console = console_log_sink()](LogLevel level, const std::string& line) {
    console(level, cli::in_flag_names(line));
  });
  // A GPU machine whose LibTorch CUDA half would not load (Note [CUDA half on demand]): say so
  // rather than train on the CPU without a word.
  if (torch_cuda_status().rfind("failed", 0) == 0) {
    log_line(LogLevel::kWarning,
             "LibTorch's CUDA half " + torch_cuda_status() + ": no GPU can be used");
  }
  CLI::App app;
  cli::configure_app(app);
  app.set_version_flag(
      "--version",
      [] {
        // Where the CUDA half is not loaded, why (Note [CUDA half on demand]).
        const std::string cuda =
            torch_cuda_status() == "loaded" ? ", CUDA" : ", CUDA " + torch_cuda_status();
        return "scaletrain " + version() + " (LibTorch " + libtorch_version() +
               (built_with_cuda() ? cuda : ", CPU only") + ")";
      },
      cli::kVersionDescription);
  cli::Action action;
  cli::add_run_command(app, action);
  cli::add_train_command(app, action);
  cli::add_check_command(app, action);
  cli::add_bench_command(app, action);
  cli::add_data_command(app, action);
  cli::add_lighthouse_command(app, action);
  return cli::parse_and_run(app, action, argc, argv);
}
