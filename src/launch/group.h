#pragma once
// One attempt's worker group of one node (internal, not public API): starts the workers under
// their guardians, relays and keeps their output, supervises them and tears the group down. Used
// by launch() for a fixed world and by the elastic launcher (Note [Elastic rendezvous]) for each
// round's world.

#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/proc_tree.h"
#include "scaletrain/launch.h"

namespace scaletrain::launch_detail {

using Clock = std::chrono::steady_clock;

// Signals reach the supervisor loop through a self-pipe: the handler only writes a byte.
extern int g_signal_pipe[2];
extern std::atomic<int> g_stop_signal;

std::string signal_name(int sig);
// How a worker's process ended, for a summary: "exited with code 3", "was killed by SIGSEGV".
std::string how_it_ended(int status);
// A worker's last non-blank error line that is not a backtrace, as ": <line>" ("" if none).
std::string last_words(const std::deque<std::string>& tail);

/// The guardian (Note [Guardian] in guardian.cpp), in the child of the launcher's fork: leads the
/// worker's own process group, dies with the launcher, starts the program with `out_fd`/`err_fd`
/// as its output, writes its pid to `pid_fd`, and exits as the program did.
[[noreturn]] void run_guardian(pid_t launcher, int out_fd, int err_fd, int pid_fd, char** argv,
                               char** envp);

// This node's place in one attempt's world: fixed for launch(), given by the rendezvous round
// for an elastic one.
struct GroupWorld {
  int node_rank = 0;
  int nnodes = 1;
  std::string master_addr;  // the workers' store (rank 0's host)
  int master_port = 0;
  int restarts = 0;   // TORCHELASTIC_RESTART_COUNT: failed attempts so far
  int log_index = 0;  // --log-dir's attempt_<k>
};

// One of a worker's output pipes, and the part of a line read from it so far.
struct Stream {
  int fd = -1;
  bool is_err = false;
  std::string partial;  // at most kMaxLineBytes plus one read
  std::unique_ptr<std::ofstream> log;
};

// One worker process and what it printed.
struct Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;          // the guardian (Note [Guardian]), leader of the worker's group
  pid_t program_pid = -1;  // the program itself, the process the user knows
  Stream out, err;         // read ends of its stdout and stderr pipes
  std::deque<std::string> err_tail;
  bool tail_redraws = false;  // the last tail line ended in '\r': the next one replaces it
  int backtrace_frames = 0;   // the last tail line stands for this many backtrace frames
  bool exited = false;
  int status = 0;
  Clock::time_point exit_time{};
  bool stopped = false;         // still running when the launcher signalled the group
  bool straggler = false;       // still running past the exit barrier (Note [Exit barrier])
  bool signal_stopped = false;  // the program is stopped by a signal (SIGSTOP...), last we looked
  Clock::time_point stopped_since{};  // since when, if so
  bool shown = true;

  bool failed() const;
};

// supervise()'s status when `recall` asked the group to stop (the rendezvous forms a new world).
constexpr int kRecalled = -1;

class Group {
 public:
  // `not_ours`: the launching process's children from before launch(), which the final sweep
  // leaves alone (Note [Descendants]). `recall`, when set, is asked about ten times a second; once
  // it says yes the running workers get SIGTERM and supervise() returns kRecalled.
  Group(const LaunchOptions& o, GroupWorld world, std::vector<pid_t> not_ours,
        std::function<bool()> recall = {})
      : o_(o), w_(std::move(world)), not_ours_(std::move(not_ours)), recall_(std::move(recall)) {}
  ~Group() {
    kill_all(SIGKILL);
    proc::kill_descendants(not_ours_);
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  void start();
  // Supervises until every worker exited. Returns 0 on success, kRecalled when recalled, else the
  // launcher's status (1: the group failed; 128+N: the launcher got signal N).
  int supervise();

 private:
  enum class Phase { kRunning, kSettling, kStopping };

  std::vector<std::string> worker_env(const Worker& w) const;
  void spawn(Worker& w);
  int poll_pipes(int timeout_ms);
  void read_from(Worker& w, Stream& s);
  void split(Worker& w, Stream& s, bool at_eof);
  void emit(Worker& w, const Stream& s, std::string_view text, char end);
  void remember(Worker& w, std::string_view text, char end);
  void close_stream(Worker& w, Stream& s);
  void reap();
  void watch_stops();
  void watch_exit_barrier();
  int report_stragglers() const;
  void advance_teardown();
  void stop_running(int sig);
  void finish_output();
  void kill_all(int sig);
  const Worker* root_cause() const;
  void report_failure(const Worker& w) const;
  std::string others_summary(const Worker& root) const;
  int report_interrupted() const;

  const LaunchOptions& o_;
  GroupWorld w_;
  std::vector<pid_t> not_ours_;
  std::function<bool()> recall_;
  std::vector<Worker> workers_;
  Phase phase_ = Phase::kRunning;
  bool stopped_by_signal_ = false;
  bool recalled_ = false;
  Clock::time_point settle_deadline_{}, kill_deadline_{};
  Clock::time_point next_stop_check_{};
  std::string stopped_out_;  // failed by --stopped-timeout: which worker, for the report
  // Note [Exit barrier]: the first worker that exited 0 (-1: none yet) and when.
  int first_done_rank_ = -1;
  Clock::time_point first_done_{};
  bool stragglers_stopped_ = false;
};

// Installs the launcher's signal handlers for one launch() and restores the old ones after.
class SignalScope {
 public:
  SignalScope();
  ~SignalScope();
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  struct sigaction old_int_ {
  }, old_term_{}, old_chld_{};
};

// Note [Descendants]: makes the calling process a child subreaper for its lifetime.
class SubreaperScope {
 public:
  SubreaperScope();
  ~SubreaperScope();
  SubreaperScope(const SubreaperScope&) = delete;
  SubreaperScope& operator=(const SubreaperScope&) = delete;

 private:
  unsigned long was_ = 0;
};

}  // namespace scaletrain::launch_detail
