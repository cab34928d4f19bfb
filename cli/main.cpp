// The `scaletrain` command-line tool. Exit status: 0 success, 1 failure of the job, 2 bad
// input (unknown subcommand or flag, bad value), 128+N when stopped by signal N.

#include <iostream>

#include "commands.h"
#include "scaletrain/error.h"
#include "scaletrain/runtime.h"
#include "scaletrain/version.h"

namespace scaletrain::cli {
namespace {
std::vector<std::string> g_args;
}
const std::vector<std::string>& program_args() { return g_args; }
}  // namespace scaletrain::cli

int main(int argc, char** argv) {
  scaletrain::cli::g_args.assign(argv, argv + argc);
  scaletrain::tune_cpu_allocator();
  using namespace scaletrain;
  CLI::App app{
      "scaletrain: take a LibTorch training job from one device to many devices, "
      "processes and machines.",
      "scaletrain"};
  app.require_subcommand(1);
  // A repeated option takes its last value, as Python's argparse (and so torchrun) does.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_version_flag(
      "--version",
      [] {
        return "scaletrain " + version() + " (LibTorch " + libtorch_version() +
               (built_with_cuda() ? ", CUDA" : ", CPU only") + ")";
      },
      "Print scaletrain's and LibTorch's versions and exit");
  app.footer("Run 'scaletrain SUBCOMMAND --help' for a subcommand's options.");

  cli::Action action;
  cli::add_run_command(app, action);
  cli::add_train_command(app, action);
  cli::add_check_command(app, action);
  cli::add_bench_command(app, action);

  // Name the unknown subcommand or flag instead of CLI11's generic "a subcommand is required".
  if (argc > 1) {
    std::string first = argv[1];
    bool known = first == "-h" || first == "--help" || first == "--version";
    for (const auto* sub : app.get_subcommands({})) known = known || sub->check_name(first);
    if (!known) {
      std::string names;
      for (const auto* sub : app.get_subcommands({})) {
        names += (names.empty() ? "" : ", ") + sub->get_name();
      }
      std::cerr << "scaletrain: unknown " << (first[0] == '-' ? "option '" : "subcommand '")
                << first << "'; subcommands are: " << names
                << "\nRun 'scaletrain --help' for usage.\n";
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "scaletrain: " << e.what() << "\nRun 'scaletrain --help' for usage.\n";
    return 2;
  }
  try {
    return action ? action() : 0;
  } catch (const UsageError& e) {
    std::cerr << "scaletrain: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "scaletrain: error: " << e.what() << "\n";
    return 1;
  }
}
