#include "subprocess.h"

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "scaletrain/launch.h"

namespace scaletrain::testing {

// Tests run several ranks as threads of one process, each with its own Gloo process group.
// c10d's FlightRecorder is one per process, and concurrent records from several groups have
// crashed it (a tree insert during ProcessGroupGloo::enqueue); real jobs have one group per
// process. Off in tests, before any group exists.
static const bool flight_recorder_off = [] {
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  return true;
}();

CommandResult run_command(const std::string& command, int timeout_s) {
  CommandResult r;
  auto t0 = std::chrono::steady_clock::now();
  std::string full = "timeout -k 5 " + std::to_string(timeout_s) + " /bin/sh -c '" + [&] {
    std::string q;
    for (char c : command) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q;
  }() + "' 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("popen failed for: " + command);
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// The launcher's choice (Note [Store port]): a port below the ephemeral range, which no test's
// outgoing connection can take before its listener binds it (a port from bind(0) could be).
int free_port() { return pick_free_port(); }

std::string cli_path() { return SCALETRAIN_CLI; }

std::string script_path(const std::string& name) { return std::string(TEST_SCRIPTS) + "/" + name; }

bool have_gnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

}  // namespace scaletrain::testing
