#pragma once
// Runs a shell command for a test and returns its exit status and combined output.

#include <string>

namespace scaletrain::testing {

struct CommandResult {
  int exit_code = -1;  // exit status, or 128+N when killed by signal N
  std::string output;  // stdout and stderr, interleaved
  double seconds = 0;  // wall time
};

/// Runs `command` under /bin/sh with a hard time limit (then it is killed and exit_code 124).
CommandResult run_command(const std::string& command, int timeout_s = 120);

/// A free TCP port on this host.
int free_port();

/// The path of the `scaletrain` binary under test, and of the tests' helper scripts.
std::string cli_path();

/// Whether gnuplot (which draws the bench plots) is on PATH.
bool have_gnuplot();
std::string script_path(const std::string& name);

}  // namespace scaletrain::testing
