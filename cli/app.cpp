// What the front and the full tool share (Note [Front] in commands.h): the app's frame, and
// parsing with one exit status for each kind of outcome.

#include <iostream>

#include "commands.h"
#include "scaletrain/error.h"

namespace scaletrain::cli {
namespace {
std::vector<std::string> g_args;

// Names the unknown subcommand or flag instead of CLI11's generic "a subcommand is required".
bool check_first_argument(CLI::App& app, int argc, char** argv) {
  if (argc <= 1) return true;
  const std::string first = argv[1];
  bool known = first == "-h" || first == "--help" || first == "--version";
  for (const auto* sub : app.get_subcommands({})) known = known || sub->check_name(first);
  if (known) return true;
  std::string names;
  for (const auto* sub : app.get_subcommands({})) {
    if (sub->get_description().empty()) continue;  // internal
    names += (names.empty() ? "" : ", ") + sub->get_name();
  }
  std::cerr << "scaletrain: unknown " << (first[0] == '-' ? "option '" : "subcommand '") << first
            << "'; subcommands are: " << names << "\nRun 'scaletrain --help' for usage.\n";
  return false;
}

}  // namespace

const std::vector<std::string>& program_args() { return g_args; }

void configure_app(CLI::App& app) {
  app.description(
      "scaletrain: take a LibTorch training job from one device to many devices, "
      "processes and machines.");
  app.name("scaletrain");
  app.require_subcommand(1);
  // A repeated option takes its last value, as Python's argparse (and so torchrun) does.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.footer("Run 'scaletrain SUBCOMMAND --help' for a subcommand's options.");
}

int parse_and_run(CLI::App& app, const Action& action, int argc, char** argv) {
  g_args.assign(argv, argv + argc);
  if (!check_first_argument(app, argc, argv)) return 2;
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

}  // namespace scaletrain::cli
