#include "scaletrain/launch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <thread>

#include "launch/net.h"
#include "launch/proc_tree.h"
#include "scaletrain/error.h"

extern char** environ;

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Signals reach the supervisor loop through a self-pipe: the handler only writes a byte.
int g_signal_pipe[2] = {-1, -1};
std::atomic<int> g_stop_signal{0};

void on_signal(int sig) {
  if (sig == SIGINT || sig == SIGTERM) g_stop_signal = sig;
  int saved = errno;
  char c = static_cast<char>(sig);
  [[maybe_unused]] auto n = write(g_signal_pipe[1], &c, 1);
  errno = saved;
}

// Note [Guardian]: each worker runs under a tiny guardian process, the leader of the worker's
// process group and a child subreaper (PR_SET_CHILD_SUBREAPER): whatever the program starts and
// leaves behind — a double fork, a `setsid` daemon that left the group — is re-parented to the
// guardian while it lives. When the launcher dies, even by SIGKILL, the kernel sends the guardian
// SIGUSR2 (PR_SET_PDEATHSIG): it kills the program, then every process below itself, then its
// whole group. Otherwise the guardian waits for the program and exits the way it did; what the
// program left behind is then re-parented to the launcher (Note [Descendants]).
volatile sig_atomic_t g_launcher_died = 0;
volatile sig_atomic_t g_program = -1;  // the guardian's program, once started

void on_launcher_death(int) {
  g_launcher_died = 1;
  if (g_program > 0) {
    kill(static_cast<pid_t>(g_program), SIGKILL);  // the guardian then sweeps the rest
  } else {
    killpg(0, SIGKILL);
  }
}

// The guardian's end when the launcher died: every process below it, then its whole group.
[[noreturn]] void guardian_kill_everything() {
  proc::kill_descendants();
  killpg(0, SIGKILL);
  _exit(128 + SIGKILL);
}

int relay_exit_of(pid_t prog) {
  int status = 0;
  // Also reaps the orphans re-parented here as they end, so that none lingers as a zombie.
  for (pid_t pid; (pid = waitpid(-1, &status, 0)) != prog;) {
    if (pid < 0 && errno != EINTR) return 126;
  }
  if (g_launcher_died) guardian_kill_everything();
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    kill(getpid(), sig);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 126;
}

// The guardian (Note [Guardian]), in the child of the launcher's fork: it leads the worker's own
// process group (teardown signals the group whole), dies with the launcher, starts the program
// and exits as it did. `pid_fd` tells the launcher the program's pid.
[[noreturn]] void run_guardian(pid_t launcher, int out_fd, int err_fd, int pid_fd, char** argv,
                               char** envp) {
  setpgid(0, 0);
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);
  signal(SIGCHLD, SIG_DFL);
  signal(SIGINT, SIG_IGN);  // the group's SIGINT/SIGTERM are for the program
  signal(SIGTERM, SIG_IGN);
  struct sigaction sa {};
  sa.sa_handler = on_launcher_death;  // no SA_RESTART: it interrupts waitpid
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR2, &sa, nullptr);
  sigset_t usr2, none;
  sigemptyset(&usr2);
  sigaddset(&usr2, SIGUSR2);
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &usr2, nullptr);  // until g_program is known
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  prctl(PR_SET_PDEATHSIG, SIGUSR2);
  pid_t prog = fork();
  if (prog == 0) {
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGUSR2, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execvpe(argv[0], argv, envp);
    dprintf(STDERR_FILENO, "cannot execute '%s': %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  g_program = prog;
  sigprocmask(SIG_SETMASK, &none, nullptr);
  if (getppid() != launcher) on_launcher_death(SIGUSR2);
  // Tell the launcher which pid the program has: that is the one its summary names.
  [[maybe_unused]] auto n = write(pid_fd, &prog, sizeof(prog));
  close(pid_fd);
  _exit(prog < 0 ? 126 : relay_exit_of(prog));
}

bool program_exists(const std::string& prog) {
  if (prog.find('/') != std::string::npos) return access(prog.c_str(), X_OK) == 0;
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    std::string dir = p.substr(start, end - start);
    if (dir.empty()) dir = ".";
    if (access((dir + "/" + prog).c_str(), X_OK) == 0) return true;
    start = end + 1;
  }
  return false;
}

bool port_is_free(int port) {
  int fd = net::bind_tcp(port, /*loopback_only=*/false, /*listen=*/false);
  if (fd >= 0) close(fd);
  return fd >= 0;
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

std::string random_run_id() {
  std::random_device rd;
  return fmt::format("{:08x}", rd());
}

// Note [Output lines]: a worker's output is cut into segments at '\n' and at '\r' (a progress
// bar redraws its line with '\r' and may never print '\n'); each segment reaches the terminal
// with its rank's prefix and its own ending, so a bar still redraws in place. A segment longer
// than kMaxLineBytes is cut there (the cut is marked) and goes on as the next one: the launcher
// holds at most one such piece per pipe, however long a line is. --log-dir files get the bytes
// as they came. The failure summary quotes at most tail_lines lines of kQuoteBytes each, and at
// most kSummaryQuoteBytes in all.
constexpr size_t kMaxLineBytes = 64 * 1024;
constexpr size_t kQuoteBytes = 512;
constexpr size_t kSummaryQuoteBytes = 8 * 1024;
constexpr char kCut = 0;  // a segment's ending when kMaxLineBytes cut it
// Note [Root cause]: the longest a failed group waits for its other workers to exit on their own.
constexpr double kSettleMaxSeconds = 1.5;
constexpr const char* kCutMark = " [line cut at 64 KiB, it goes on in the next line]";

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
  bool signal_stopped = false;  // the program is stopped by a signal (SIGSTOP...), last we looked
  bool shown = true;

  bool failed() const { return exited && !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }
};

class Group {
 public:
  // `not_ours`: the launching process's children from before launch(), which the final sweep
  // leaves alone (Note [Descendants]).
  Group(const LaunchOptions& o, int attempt, std::vector<pid_t> not_ours)
      : o_(o), attempt_(attempt), not_ours_(std::move(not_ours)) {}
  ~Group() {
    kill_all(SIGKILL);
    proc::kill_descendants(not_ours_);
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  void start();
  // Supervises until every worker exited. Returns 0 on success, else the launcher's status.
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
  void advance_teardown();
  void stop_running(int sig);
  void finish_output();
  void kill_all(int sig);
  const Worker* root_cause() const;
  void report_failure(const Worker& w) const;
  std::string others_summary(const Worker& root) const;
  int report_interrupted() const;

  const LaunchOptions& o_;
  int attempt_;
  std::vector<pid_t> not_ours_;
  std::vector<Worker> workers_;
  Phase phase_ = Phase::kRunning;
  bool stopped_by_signal_ = false;
  Clock::time_point settle_deadline_{}, kill_deadline_{};
  Clock::time_point next_stop_check_{};
  Clock::time_point all_stopped_since_{};
  bool all_stopped_ = false;  // failed by --stopped-timeout
};

std::vector<std::string> Group::worker_env(const Worker& w) const {
  const int world = o_.nproc_per_node * o_.nnodes;
  std::vector<std::pair<std::string, std::string>> set = {
      {"RANK", std::to_string(w.rank)},
      {"LOCAL_RANK", std::to_string(w.local_rank)},
      {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_WORLD_SIZE", std::to_string(o_.nproc_per_node)},
      {"GROUP_RANK", std::to_string(o_.node_rank)},
      {"ROLE_RANK", std::to_string(w.rank)},
      {"ROLE_WORLD_SIZE", std::to_string(world)},
      {"MASTER_ADDR", o_.master_addr},
      {"MASTER_PORT", std::to_string(o_.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(attempt_)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o_.max_restarts)},
      {"TORCHELASTIC_RUN_ID", o_.run_id},
      {"SCALETRAIN_NNODES", std::to_string(o_.nnodes)},
      {"SCALETRAIN_RDZV_TIMEOUT", fmt::format("{}", o_.rdzv_timeout_s)},
  };
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    std::string key = kv.substr(0, kv.find('='));
    bool overridden = false;
    for (auto& [k, v] : set) overridden |= (k == key);
    if (!overridden) env.push_back(kv);
  }
  for (auto& [k, v] : set) env.push_back(k + "=" + v);
  // Like torchrun, keep several workers from each starting a full-size thread pool.
  if (!std::getenv("OMP_NUM_THREADS")) {
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env.push_back(fmt::format("OMP_NUM_THREADS={}",
                              std::max(1u, cores / static_cast<unsigned>(o_.nproc_per_node))));
  }
  return env;
}

void Group::spawn(Worker& w) {
  int out[2], err[2], pid_pipe[2];
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 || pipe2(pid_pipe, O_CLOEXEC) != 0) {
    throw Error(fmt::format("cannot create pipes for rank {}: {}", w.rank, strerror(errno)));
  }
  std::vector<std::string> env = worker_env(w);
  std::vector<char*> envp, argv;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> cmd = o_.command;
  for (auto& s : cmd) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();

  pid_t pid = fork();
  if (pid < 0) throw Error(fmt::format("fork failed for rank {}: {}", w.rank, strerror(errno)));
  if (pid == 0) run_guardian(parent, out[1], err[1], pid_pipe[1], argv.data(), envp.data());
  setpgid(pid, pid);  // also from the parent, so that kill_all never misses it
  close(out[1]);
  close(err[1]);
  close(pid_pipe[1]);
  pid_t prog = -1;
  ssize_t got;
  while ((got = read(pid_pipe[0], &prog, sizeof(prog))) < 0 && errno == EINTR) {
  }
  close(pid_pipe[0]);
  w.program_pid = got == static_cast<ssize_t>(sizeof(prog)) ? prog : -1;
  w.pid = pid;
  w.out.fd = out[0];
  w.err.fd = err[0];
  w.err.is_err = true;
}

void Group::start() {
  std::string dir;
  if (!o_.log_dir.empty()) {
    dir = fmt::format("{}/attempt_{}", o_.log_dir, attempt_);
    fs::create_directories(dir);
  }
  workers_.resize(static_cast<size_t>(o_.nproc_per_node));
  for (int i = 0; i < o_.nproc_per_node; ++i) {
    Worker& w = workers_[static_cast<size_t>(i)];
    w.local_rank = i;
    w.rank = o_.node_rank * o_.nproc_per_node + i;
    w.shown = !o_.quiet;
    if (w.shown && !o_.show_ranks.empty()) {
      w.shown =
          std::find(o_.show_ranks.begin(), o_.show_ranks.end(), w.rank) != o_.show_ranks.end();
    }
    if (!dir.empty()) {
      w.out.log = std::make_unique<std::ofstream>(fmt::format("{}/rank_{}.stdout", dir, w.rank));
      w.err.log = std::make_unique<std::ofstream>(fmt::format("{}/rank_{}.stderr", dir, w.rank));
    }
    spawn(w);
    // A SIGINT/SIGTERM while workers are still being started: start no more; supervise() stops
    // the ones that run.
    if (g_stop_signal.load() != 0) {
      workers_.resize(static_cast<size_t>(i) + 1);
      return;
    }
  }
}

// A line of a C++ backtrace, as LibTorch's errors print some 25 under their message.
bool is_backtrace_frame(std::string_view text) {
  const size_t start = text.find_first_not_of(" \t");
  return start != std::string_view::npos && text.substr(start, 7) == "frame #";
}

void Group::remember(Worker& w, std::string_view text, char end) {
  // A backtrace counts as one line, so that it does not push its error message out of the tail.
  if (is_backtrace_frame(text)) {
    if (w.backtrace_frames == 0) w.err_tail.emplace_back();
    w.err_tail.back() = fmt::format("[{} backtrace frame(s) left out]", ++w.backtrace_frames);
    w.tail_redraws = false;
    return;
  }
  w.backtrace_frames = 0;
  std::string line(text.substr(0, kQuoteBytes));
  if (text.size() > kQuoteBytes)
    line += fmt::format(" [... {} bytes more]", text.size() - kQuoteBytes);
  if (w.tail_redraws && !w.err_tail.empty()) {
    w.err_tail.back() = std::move(line);
  } else {
    w.err_tail.push_back(std::move(line));
  }
  w.tail_redraws = end == '\r';
  while (static_cast<int>(w.err_tail.size()) > o_.tail_lines) w.err_tail.pop_front();
}

// One segment of a worker's output (Note [Output lines]), ended by '\n', '\r' or a cut.
void Group::emit(Worker& w, const Stream& s, std::string_view text, char end) {
  if (text.empty() && end == '\r') return;  // a bar's leading '\r'
  if (s.is_err) remember(w, text, end);
  if (!w.shown) return;
  std::string out = fmt::format("[rank{}]:", w.rank);
  out.append(text);
  out += end == kCut ? std::string(kCutMark) + "\n" : std::string(1, end);
  const int fd = s.is_err ? STDERR_FILENO : STDOUT_FILENO;
  for (size_t done = 0; done < out.size();) {
    const ssize_t n = write(fd, out.data() + done, out.size() - done);
    if (n <= 0 && errno != EINTR) break;
    if (n > 0) done += static_cast<size_t>(n);
  }
}

// Emits every complete segment of `s.partial`; at EOF the rest too.
void Group::split(Worker& w, Stream& s, bool at_eof) {
  const std::string& p = s.partial;
  size_t start = 0, i = 0;
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 == p.size() && !at_eof) break;  // "\r\n" split between reads
      const bool crlf = c == '\r' && i + 1 < p.size() && p[i + 1] == '\n';
      emit(w, s, std::string_view(p).substr(start, i - start), crlf ? '\n' : c);
      i += crlf ? 2 : 1;
      start = i;
    } else if (i + 1 - start >= kMaxLineBytes) {
      emit(w, s, std::string_view(p).substr(start, kMaxLineBytes), kCut);
      start = ++i;
    } else {
      ++i;
    }
  }
  s.partial.erase(0, start);
  if (at_eof && !s.partial.empty()) {
    emit(w, s, s.partial, '\n');
    s.partial.clear();
  }
}

void Group::close_stream(Worker& w, Stream& s) {
  if (s.fd < 0) return;
  split(w, s, /*at_eof=*/true);
  close(s.fd);
  s.fd = -1;
}

void Group::read_from(Worker& w, Stream& s) {
  char buf[8192];
  const ssize_t n = read(s.fd, buf, sizeof(buf));
  if (n < 0 && errno == EINTR) return;
  if (n <= 0) {  // EOF (or error): flush what is left and stop watching this pipe
    close_stream(w, s);
    return;
  }
  if (s.log) s.log->write(buf, n).flush();
  s.partial.append(buf, static_cast<size_t>(n));
  split(w, s, /*at_eof=*/false);
}

// Waits up to `timeout_ms` for output or a signal and reads what came. Returns how many pipes
// (the signal pipe included) were ready.
int Group::poll_pipes(int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, Stream*>> owners;
  for (auto& w : workers_) {
    for (Stream* s : {&w.out, &w.err}) {
      if (s->fd >= 0) fds.push_back({s->fd, POLLIN, 0}), owners.push_back({&w, s});
    }
  }
  fds.push_back({g_signal_pipe[0], POLLIN, 0});
  const int ready = poll(fds.data(), fds.size(), timeout_ms);
  if (ready < 0 && errno != EINTR) throw Error(fmt::format("poll failed: {}", strerror(errno)));
  for (size_t i = 0; ready > 0 && i + 1 < fds.size(); ++i) {
    if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
      read_from(*owners[i].first, *owners[i].second);
  }
  if (ready > 0 && (fds.back().revents & POLLIN)) {
    char buf[64];
    [[maybe_unused]] auto n = read(g_signal_pipe[0], buf, sizeof(buf));
  }
  return std::max(ready, 0);
}

void Group::reap() {
  int status = 0;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    for (auto& w : workers_) {
      if (w.pid != pid) continue;  // else: a worker's orphan, re-parented here (Note [Descendants])
      w.exited = true;
      w.status = status;
      w.exit_time = Clock::now();
      if (w.failed() && phase_ == Phase::kRunning) {
        // Note [Root cause]: the others get a moment to exit on their own before SIGTERM.
        phase_ = Phase::kSettling;
        const double settle_s = std::min(kSettleMaxSeconds, o_.grace_period_s / 2);
        settle_deadline_ =
            Clock::now() + std::chrono::milliseconds(static_cast<long>(settle_s * 1000));
      }
    }
  }
}

// A worker stopped by a signal (SIGSTOP, a debugger) neither runs nor exits: its peers wait for it
// until their collective timeout, which then names it (Note [Heartbeats]). Said as it happens,
// once a second at most, and again when it goes on. When every worker left is stopped, nothing
// can time out any more: past --stopped-timeout the group counts as failed.
void Group::watch_stops() {
  if (Clock::now() < next_stop_check_) return;
  next_stop_check_ = Clock::now() + std::chrono::seconds(1);
  bool all = phase_ == Phase::kRunning;
  for (auto& w : workers_) {
    if (w.exited) continue;
    const bool now = proc::is_stopped(w.program_pid);
    all = all && now;
    if (now && !w.signal_stopped) {
      spdlog::warn(
          "scaletrain run: rank {} (pid {}) is stopped by a signal; its peers wait for it until "
          "their collective timeout (--timeout). `kill -CONT {}` lets it go on.",
          w.rank, w.program_pid, w.program_pid);
    } else if (!now && w.signal_stopped) {
      spdlog::info("scaletrain run: rank {} (pid {}) goes on", w.rank, w.program_pid);
    }
    w.signal_stopped = now;
  }
  if (!all) {
    all_stopped_since_ = {};
    return;
  }
  if (all_stopped_since_ == Clock::time_point{}) all_stopped_since_ = Clock::now();
  const std::chrono::duration<double> stuck = Clock::now() - all_stopped_since_;
  if (stuck.count() < o_.stopped_timeout_s) return;
  spdlog::error(
      "scaletrain run: every worker left is stopped by a signal for {:.0f} s (--stopped-timeout): "
      "nothing can time out; the group counts as failed",
      stuck.count());
  all_stopped_ = true;
  stop_running(SIGTERM);  // kill_all continues them into it
}

void Group::stop_running(int sig) {
  phase_ = Phase::kStopping;
  kill_deadline_ =
      Clock::now() + std::chrono::milliseconds(static_cast<long>(o_.grace_period_s * 1000));
  for (auto& w : workers_) w.stopped = w.stopped || !w.exited;
  kill_all(sig);
}

void Group::advance_teardown() {
  const int stop = g_stop_signal.load();
  if (stop != 0 && !stopped_by_signal_) {
    stopped_by_signal_ = true;
    stop_running(stop);
  }
  if (phase_ == Phase::kSettling && Clock::now() >= settle_deadline_) stop_running(SIGTERM);
  if (phase_ == Phase::kStopping && Clock::now() > kill_deadline_) kill_all(SIGKILL);
}

void Group::kill_all(int sig) {
  for (auto& w : workers_) {
    if (w.pid <= 0 || w.exited) continue;
    killpg(w.pid, sig);
    // A stopped process takes SIGTERM only once continued: else it would wait for SIGKILL.
    if (sig != SIGKILL) killpg(w.pid, SIGCONT);
  }
}

// Every worker has exited: nothing it started outlives the attempt (Note [Descendants]), and
// what the workers wrote before they died is read to the end.
void Group::finish_output() {
  for (auto& w : workers_) {
    if (w.pid > 0) killpg(w.pid, SIGKILL);  // a shell's background job ignores SIGINT
  }
  proc::kill_descendants(not_ours_);
  // The pipes now reach EOF, unless a process outside the tree holds them: bounded wait.
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  bool open = true;
  while (open && Clock::now() < deadline) {
    open = false;
    for (auto& w : workers_) open = open || w.out.fd >= 0 || w.err.fd >= 0;
    if (open && poll_pipes(200) == 0) break;
  }
  for (auto& w : workers_) {
    close_stream(w, w.out);
    close_stream(w, w.err);
  }
}

int Group::supervise() {
  while (true) {
    reap();
    watch_stops();
    advance_teardown();
    bool all_exited = true;
    for (auto& w : workers_) all_exited = all_exited && w.exited;
    if (all_exited) break;
    poll_pipes(100);
  }
  finish_output();
  if (stopped_by_signal_) return report_interrupted();
  if (all_stopped_) {
    const std::string msg = fmt::format(
        "scaletrain run: worker group failed (attempt {} of {}): every worker was stopped by a "
        "signal for --stopped-timeout {} s\n",
        attempt_ + 1, o_.max_restarts + 1, o_.stopped_timeout_s);
    [[maybe_unused]] auto n = write(STDERR_FILENO, msg.data(), msg.size());
    return 1;
  }
  if (const Worker* root = root_cause()) {
    report_failure(*root);
    return 1;
  }
  return 0;
}

int Group::report_interrupted() const {
  const int sig = g_stop_signal.load();
  const std::string msg =
      fmt::format("scaletrain run: interrupted by {}: stopped the {} worker(s) of attempt {}{}\n",
                  signal_name(sig), workers_.size(), attempt_ + 1,
                  static_cast<int>(workers_.size()) < o_.nproc_per_node
                      ? fmt::format(" ({} of {} had started)", workers_.size(), o_.nproc_per_node)
                      : "");
  [[maybe_unused]] auto n = write(STDERR_FILENO, msg.data(), msg.size());
  return 128 + sig;
}

// Whether a worker's last error lines say it failed because another rank did (Note [Root cause]).
bool reads_as_consequence(const std::deque<std::string>& tail) {
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

// A worker's last non-blank error line that is not a backtrace, for a one-line mention.
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
      attempt_ + 1, o_.max_restarts + 1, w.rank, w.local_rank, o_.node_rank,
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
    msg += fmt::format("  full logs: {}/attempt_{}/rank_{}.stderr\n", o_.log_dir, attempt_, w.rank);
  }
  [[maybe_unused]] auto n = write(STDERR_FILENO, msg.data(), msg.size());
}

// Installs the launcher's signal handlers for one launch() and restores the old ones after.
class SignalScope {
 public:
  SignalScope() {
    if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw Error(fmt::format("cannot create the signal pipe: {}", strerror(errno)));
    }
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGCHLD, &sa, &old_chld_);
  }
  ~SignalScope() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGCHLD, &old_chld_, nullptr);
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  struct sigaction old_int_ {
  }, old_term_{}, old_chld_{};
};

// Note [Descendants]: for one launch() the launcher is a child subreaper, so that what a worker
// leaves behind when it exits (a double fork, a `setsid` daemon outside its process group) is
// re-parented to the launcher (from the worker's guardian, Note [Guardian]) instead of to init.
// When an attempt ends, the launcher kills every process below itself but the children it had
// before launch() (and their subtrees): nothing a worker started outlives its attempt.
class SubreaperScope {
 public:
  SubreaperScope() {
    int was = 0;
    prctl(PR_GET_CHILD_SUBREAPER, &was);
    was_ = was;
    prctl(PR_SET_CHILD_SUBREAPER, 1);
  }
  ~SubreaperScope() { prctl(PR_SET_CHILD_SUBREAPER, was_); }
  SubreaperScope(const SubreaperScope&) = delete;
  SubreaperScope& operator=(const SubreaperScope&) = delete;

 private:
  unsigned long was_ = 0;
};

}  // namespace

int pick_free_port() {
  int fd = net::bind_tcp(0, /*loopback_only=*/false, /*listen=*/false);
  int port = fd >= 0 ? net::bound_port(fd) : -1;
  if (fd >= 0) close(fd);
  if (port <= 0) throw Error(fmt::format("cannot find a free port: {}", strerror(errno)));
  return port;
}

int auto_nproc_per_node(bool use_gpus) {
  int gpus = 0;
  std::error_code ec;
  if (fs::is_directory("/proc/driver/nvidia/gpus", ec)) {
    for ([[maybe_unused]] auto& e : fs::directory_iterator("/proc/driver/nvidia/gpus", ec)) ++gpus;
  }
  if (const char* vis = std::getenv("CUDA_VISIBLE_DEVICES"); vis && gpus > 0) {
    std::string v = vis;
    gpus = v.empty() ? 0 : 1 + static_cast<int>(std::count(v.begin(), v.end(), ','));
  }
  if (gpus > 0 && use_gpus) return gpus;
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
}

// File descriptors and processes the launcher needs for `o`: it keeps two pipes' read ends
// per worker (and two log files with --log-dir), and each worker is two processes.
void check_machine_limits(const LaunchOptions& o) {
  const int64_t n = o.nproc_per_node;
  const int64_t fds = 32 + n * (o.log_dir.empty() ? 2 : 4) + 4;  // + stdio, signal pipe, spawn
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_max != RLIM_INFINITY &&
      static_cast<int64_t>(files.rlim_max) < fds) {
    throw UsageError(fmt::format(
        "--nproc-per-node {} needs about {} open files in the launcher, but this process may "
        "open at most {} (ulimit -n); start fewer workers or raise the limit",
        n, fds, files.rlim_max));
  }
  rlimit procs{};
  if (geteuid() != 0 && getrlimit(RLIMIT_NPROC, &procs) == 0 && procs.rlim_cur != RLIM_INFINITY &&
      static_cast<int64_t>(procs.rlim_cur) < 2 * n) {
    throw UsageError(fmt::format(
        "--nproc-per-node {} needs {} processes (each worker and its guardian), but this user may "
        "run at most {} (ulimit -u); start fewer workers or raise the limit",
        n, 2 * n, procs.rlim_cur));
  }
}

// Raises the soft limit on open files to what the workers need (up to the hard limit, which
// check_machine_limits() already compared).
void raise_file_limit(const LaunchOptions& o) {
  const auto want = static_cast<rlim_t>(32 + o.nproc_per_node * (o.log_dir.empty() ? 2 : 4) + 4);
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < want) {
    files.rlim_cur = std::min(want, files.rlim_max);
    setrlimit(RLIMIT_NOFILE, &files);
  }
}

void validate(LaunchOptions& o) {
  if (o.command.empty()) {
    throw UsageError("no program to run: give it after '--', e.g. `scaletrain run -- ./train`");
  }
  if (o.nproc_per_node < 1 || o.nproc_per_node > kMaxWorkersPerNode) {
    throw UsageError(fmt::format(
        "--nproc-per-node {} must be in [1, {}] (or 'auto': one per GPU, else one per core)",
        o.nproc_per_node, kMaxWorkersPerNode));
  }
  check_machine_limits(o);
  if (o.nnodes < 1) throw UsageError(fmt::format("--nnodes {} must be at least 1", o.nnodes));
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    throw UsageError(
        fmt::format("--node-rank {} must be in [0, {}): number the nodes 0 .. --nnodes - 1",
                    o.node_rank, o.nnodes));
  }
  if (o.max_restarts < 0) {
    throw UsageError(fmt::format("--max-restarts {} must be 0 or more", o.max_restarts));
  }
  if (!(o.rdzv_timeout_s > 0) || !std::isfinite(o.rdzv_timeout_s)) {
    throw UsageError(
        fmt::format("--rdzv-timeout {} must be a positive number of seconds", o.rdzv_timeout_s));
  }
  if (!(o.grace_period_s >= 0) || !std::isfinite(o.grace_period_s)) {
    throw UsageError(
        fmt::format("--grace-period {} must be 0 or more seconds (between SIGTERM and SIGKILL)",
                    o.grace_period_s));
  }
  if (!(o.stopped_timeout_s > 0) || !std::isfinite(o.stopped_timeout_s)) {
    throw UsageError(fmt::format("--stopped-timeout {} must be a positive number of seconds",
                                 o.stopped_timeout_s));
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    throw UsageError(fmt::format("--master-port {} is not a TCP port (0-65535)", o.master_port));
  }
  if (o.master_port == 0) {
    if (o.nnodes > 1) {
      throw UsageError(
          "--master-port 0 (pick a free port) works on one node only: with "
          "--nnodes > 1 every node must be given the same port");
    }
    o.master_port = pick_free_port();
  } else if (o.node_rank == 0 && !port_is_free(o.master_port)) {
    throw UsageError(fmt::format(
        "--master-port {} is busy on this host (another job's store?); choose another port, "
        "or 0 to pick a free one",
        o.master_port));
  }
  if (!program_exists(o.command[0])) {
    throw UsageError(
        fmt::format("program '{}' not found or not executable (PATH is searched "
                    "when it has no '/')",
                    o.command[0]));
  }
  if (o.run_id.empty()) o.run_id = o.nnodes == 1 ? random_run_id() : "none";
  for (int r : o.show_ranks) {
    if (r < 0 || r >= o.nproc_per_node * o.nnodes) {
      throw UsageError(fmt::format("rank {} given to show is outside the world of {} ranks", r,
                                   o.nproc_per_node * o.nnodes));
    }
  }
}

int launch(const LaunchOptions& o) {
  raise_file_limit(o);
  SignalScope signals;
  SubreaperScope subreaper;
  const std::vector<pid_t> not_ours = proc::children_of_self();
  for (int attempt = 0; attempt <= o.max_restarts; ++attempt) {
    spdlog::info(
        "scaletrain run: starting {} worker(s) on node {}/{} (world {}, master {}:{}, "
        "run '{}', attempt {} of {})",
        o.nproc_per_node, o.node_rank, o.nnodes, o.nproc_per_node * o.nnodes, o.master_addr,
        o.master_port, o.run_id, attempt + 1, o.max_restarts + 1);
    int status;
    {
      Group group(o, attempt, not_ours);
      group.start();
      status = group.supervise();
    }
    if (status == 0 || status >= 128) return status;
    if (attempt < o.max_restarts) {
      spdlog::warn("scaletrain run: restarting the worker group ({} of {} restarts)", attempt + 1,
                   o.max_restarts);
    }
  }
  return 1;
}

}  // namespace scaletrain
