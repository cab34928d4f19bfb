// `scaletrain`, the front (Note [Front] in commands.h): built without LibTorch, it runs
// `scaletrain run` itself and execs the full tool for every other subcommand and --version.

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "commands.h"

namespace scaletrain::cli {
namespace {

namespace fs = std::filesystem;
constexpr const char* kToolName = "scaletrain-tool";

bool runs_in_the_tool(const std::string& first) {
  if (first == "--version") return true;
  for (const auto& sub : kToolSubcommands) {
    if (first == sub.name) return true;
  }
  return false;
}

// Beside the front (the build tree), else where the install puts it relative to bin/.
int exec_tool(char** argv) {
  std::error_code ec;
  const fs::path dir = fs::read_symlink("/proc/self/exe", ec).parent_path();
  const fs::path places[] = {dir / kToolName, dir / SCALETRAIN_TOOL_FROM_BINDIR / kToolName};
  for (const auto& tool : places) {
    if (access(tool.c_str(), X_OK) != 0) continue;
    execv(tool.c_str(), argv);
    std::cerr << "scaletrain: cannot start " << tool.string() << ": " << std::strerror(errno)
              << "\n";
    return 1;
  }
  std::cerr << "scaletrain: '" << argv[1] << "' needs the full tool, " << kToolName
            << ", which is neither at " << places[0].lexically_normal().string() << " nor at "
            << places[1].lexically_normal().string()
            << ": the installation is incomplete (cmake --install installs both)\n";
  return 1;
}

}  // namespace
}  // namespace scaletrain::cli

int main(int argc, char** argv) {
  using namespace scaletrain::cli;
  if (argc > 1 && runs_in_the_tool(argv[1])) return exec_tool(argv);
  CLI::App app;
  configure_app(app);
  app.add_flag("--version", kVersionDescription);  // listed here, answered by the full tool
  Action action;
  add_run_command(app, action);
  for (const auto& sub : kToolSubcommands) {
    auto* stub = app.add_subcommand(sub.name, sub.description);
    if (*sub.description == '\0') stub->group("");  // internal: not listed
  }
  return parse_and_run(app, action, argc, argv);
}
