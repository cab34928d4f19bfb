// The group's words when it ends: the root cause of a failure (Note [Root cause]) and an
// interruption.
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "launch/group.h"

namespace scaletrain::launch_detail {

// The failure summary quotes at most this many bytes of the root cause's error output.
constexpr size_t kSummaryQuoteBytes = 8 * 1024;

int Group::report_interrupted() const {
  const int sig = g_stop_signal.load();
  const std::string msg =
      fmt::format("scaletrain run: interrupted by {}: stopped the {} worker(s) of attempt {}{}\n",
                  signal_name(sig), workers_.size(), w_.restarts + 1,
                  static_cast<int>(workers_.size()) < o_.nproc_per_node
                      ? fmt::format(" ({} of {} had started)", workers_.size(), o_.nproc_per_node)
                      : "");
  [[maybe_unused]] auto n = write(STDERR_FILENO, msg.data(), msg.size());
  return 128 + sig;
}

// Whether a worker's last error lines say it failed because another rank did (Note [Root cause]).
static bool reads_as_consequence(const std::deque<std::string>& tail) {
  static const char* const kMarks[] = {
      "left the group",    "exited before joining", "by peer",       "connection reset",
      "connection closed", "connection refused",    "broken pipe",   "peer closed",
      "peer left",         "never joined",          "never arrived", "remote process exited",
      "socket timeout"};
  const size_t from = tail.size() > 5 ? tail.size() - 5 : 0;
  for (size_t i = from; i < tail.size(); ++i) {
    std::string lower = tail[i];
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    for (const char* mark : kMarks) {
      if (lower.find(mark) != std::string::npos) return true;
    }
  }
  return false;
}

// Note [Root cause]: when one rank fails, the others soon fail too (their peer is gone), and one
// of them may even exit first. The launcher names the worker that failed on its own (before it
// was signalled) and whose error does not read as a consequence of another's, the earliest such;
// when every error reads as a consequence, the earliest failure.
const Worker* Group::root_cause() const {
  const Worker *first = nullptr, *first_own = nullptr;
  for (const auto& w : workers_) {
    if (!w.failed() || w.stopped) continue;
    if (first == nullptr || w.exit_time < first->exit_time) first = &w;
    if (!reads_as_consequence(w.err_tail) &&
        (first_own == nullptr || w.exit_time < first_own->exit_time)) {
      first_own = &w;
    }
  }
  return first_own != nullptr ? first_own : first;
}

std::string last_words(const std::deque<std::string>& tail) {
  for (auto it = tail.rbegin(); it != tail.rend(); ++it) {
    if (it->find_first_not_of(" \t") == std::string::npos || (*it)[0] == '[') continue;
    return ": " + it->substr(0, 200);
  }
  return "";
}

std::string how_it_ended(int status) {
  return WIFSIGNALED(status) ? fmt::format("was killed by {}", signal_name(WTERMSIG(status)))
                             : fmt::format("exited with code {}", WEXITSTATUS(status));
}

// The other workers, one line each: those that failed too (with their last error line), and
// how many the launcher stopped.
std::string Group::others_summary(const Worker& root) const {
  std::string msg;
  int listed = 0, more = 0, stopped = 0;
  for (const auto& w : workers_) {
    if (&w == &root || !w.exited) continue;
    if (w.stopped) {
      stopped += 1;
      continue;
    }
    if (!w.failed()) continue;
    if (listed == 8) {
      more += 1;
      continue;
    }
    listed += 1;
    const bool earlier = w.exit_time < root.exit_time;
    msg += fmt::format(
        "  rank {} (pid {}) {} {}{}{}\n", w.rank, w.program_pid > 0 ? w.program_pid : w.pid,
        how_it_ended(w.status), earlier ? "before it" : "after it",
        reads_as_consequence(w.err_tail) ? ", as a consequence" : "", last_words(w.err_tail));
  }
  if (more > 0) msg += fmt::format("  and {} more rank(s) failed after it\n", more);
  if (stopped > 0) msg += fmt::format("  {} other worker(s) were stopped\n", stopped);
  return msg;
}

void Group::report_failure(const Worker& w) const {
  std::string msg = fmt::format(
      "scaletrain run: worker group failed (attempt {} of {})\n"
      "  rank {} (local rank {}, node {}, pid {}) {}\n",
      w_.restarts + 1, o_.max_restarts + 1, w.rank, w.local_rank, w_.node_rank,
      w.program_pid > 0 ? w.program_pid : w.pid, how_it_ended(w.status));
  size_t from = 0, bytes = 0;
  for (size_t i = w.err_tail.size();
       i > 0 && bytes + w.err_tail[i - 1].size() <= kSummaryQuoteBytes; --i) {
    bytes += w.err_tail[i - 1].size();
    from = i - 1;
  }
  if (w.err_tail.empty()) {
    msg += "  it printed nothing on its error output.\n";
  } else {
    msg += fmt::format("  last {} lines of its error output:\n", w.err_tail.size() - from);
    for (size_t i = from; i < w.err_tail.size(); ++i) msg += "    " + w.err_tail[i] + "\n";
  }
  msg += others_summary(w);
  if (!o_.log_dir.empty()) {
    msg += fmt::format("  full logs: {}/attempt_{}/rank_{}.stderr\n", o_.log_dir, w_.log_index,
                       w.rank);
  }
  [[maybe_unused]] auto n = write(STDERR_FILENO, msg.data(), msg.size());
}

}  // namespace scaletrain::launch_detail
