// Note [Exit barrier]
// ~~~~~~~~~~~~~~~~~~~
// A job is done when every worker has exited 0. A worker that hangs after its peers finished (a
// rank stuck in a collective whose peers have left, a thread that never ends) would hold the
// launcher for good, as it holds torchrun's: nothing fails, so no teardown starts. Once the first
// worker exits 0, the others therefore get `exit_barrier_timeout_s` (300 s: room for a last
// checkpoint or model.pt to be written) to exit too. Those still running then are stragglers:
// they are stopped as a failed group's workers are (SIGTERM, SIGKILL after the grace period) and
// the group fails, naming each straggler and how long it ran after the first exit, so that
// --max-restarts and the exit status treat the job as failed rather than done. 0 waits for ever.
// A failure of any worker before the barrier passes is an ordinary failure (Note [Root cause]).

#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "launch/group.h"

namespace scaletrain::launch_detail {

void Group::watch_exit_barrier() {
  if (first_done_rank_ < 0 || phase_ != Phase::kRunning || !(o_.exit_barrier_timeout_s > 0)) {
    return;
  }
  const std::chrono::duration<double> waited = Clock::now() - first_done_;
  if (waited.count() < o_.exit_barrier_timeout_s) return;
  std::string ranks;
  for (auto& w : workers_) {
    if (w.exited) continue;
    w.straggler = true;
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(w.rank);
  }
  if (ranks.empty()) return;  // every worker has exited: the group is done
  stragglers_stopped_ = true;
  spdlog::error(
      "scaletrain run: rank {} exited 0 {:.1f} s ago and rank(s) {} still run "
      "(--exit-barrier-timeout {} s): stopping them",
      first_done_rank_, waited.count(), ranks, o_.exit_barrier_timeout_s);
  stop_running(SIGTERM);
}

int Group::report_stragglers() const {
  int count = 0;
  std::string lines;
  for (const auto& w : workers_) {
    if (!w.straggler) continue;
    ++count;
    const std::chrono::duration<double> ran = w.exit_time - first_done_;
    lines += fmt::format(
        "  rank {} (local rank {}, node {}, pid {}) ran {:.1f} s after rank {}'s exit, then was "
        "stopped: it {}{}\n",
        w.rank, w.local_rank, w_.node_rank, w.program_pid > 0 ? w.program_pid : w.pid, ran.count(),
        first_done_rank_, how_it_ended(w.status), last_words(w.err_tail));
  }
  const std::string msg = fmt::format(
      "scaletrain run: worker group failed (attempt {} of {}): rank {} exited 0, and {} other "
      "worker(s) were still running --exit-barrier-timeout {} s later\n{}"
      "  a worker that hangs once its peers are done holds the job; if they needed longer to "
      "finish, raise --exit-barrier-timeout (0 waits for ever)\n",
      w_.restarts + 1, o_.max_restarts + 1, first_done_rank_, count, o_.exit_barrier_timeout_s,
      lines);
  [[maybe_unused]] auto n = write(STDERR_FILENO, msg.data(), msg.size());
  return 1;
}

}  // namespace scaletrain::launch_detail
