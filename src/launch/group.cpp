#include "launch/group.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

#include "scaletrain/error.h"
#include "transport/segment.h"

extern char** environ;

namespace scaletrain::launch_detail {

int g_signal_pipe[2] = {-1, -1};
std::atomic<int> g_stop_signal{0};

namespace {

namespace fs = std::filesystem;

void on_signal(int sig) {
  if (sig == SIGINT || sig == SIGTERM) g_stop_signal = sig;
  int saved = errno;
  char c = static_cast<char>(sig);
  [[maybe_unused]] auto n = write(g_signal_pipe[1], &c, 1);
  errno = saved;
}

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// Note [Output lines]: a worker's output is cut into segments at '\n' and at '\r' (a progress
// bar redraws its line with '\r' and may never print '\n'); each segment reaches the terminal
// with its rank's prefix and its own ending, so a bar still redraws in place. A segment longer
// than kMaxLineBytes is cut there (the cut is marked) and goes on as the next one: the launcher
// holds at most one such piece per pipe, however long a line is. --log-dir files get the bytes
// as they came. The failure summary quotes at most tail_lines lines of kQuoteBytes each, and at
// most kSummaryQuoteBytes in all (group_report.cpp).
constexpr size_t kMaxLineBytes = 64 * 1024;
constexpr size_t kQuoteBytes = 512;
constexpr char kCut = 0;  // a segment's ending when kMaxLineBytes cut it
// Note [Root cause]: the longest a failed group waits for its other workers to exit on their own.
constexpr double kSettleMaxSeconds = 1.5;
constexpr const char* kCutMark = " [line cut at 64 KiB, it goes on in the next line]";

bool Worker::failed() const { return exited && !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

std::vector<std::string> Group::worker_env(const Worker& w) const {
  const int world = o_.nproc_per_node * w_.nnodes;
  std::vector<std::pair<std::string, std::string>> set = {
      {"RANK", std::to_string(w.rank)},
      {"LOCAL_RANK", std::to_string(w.local_rank)},
      {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_WORLD_SIZE", std::to_string(o_.nproc_per_node)},
      {"GROUP_RANK", std::to_string(w_.node_rank)},
      {"ROLE_RANK", std::to_string(w.rank)},
      {"ROLE_WORLD_SIZE", std::to_string(world)},
      {"MASTER_ADDR", w_.master_addr},
      {"MASTER_PORT", std::to_string(w_.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(w_.restarts)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o_.max_restarts)},
      {"TORCHELASTIC_RUN_ID", o_.run_id},
      {"GROUP_WORLD_SIZE", std::to_string(w_.nnodes)},
      {"SCALETRAIN_NNODES", std::to_string(w_.nnodes)},
      {"SCALETRAIN_RDZV_TIMEOUT", fmt::format("{}", o_.rdzv_timeout_s)},
      {"SCALETRAIN_WORLD_SECRET", o_.secret},  // Note [Job secret]: in the environment only
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
    dir = fmt::format("{}/attempt_{}", o_.log_dir, w_.log_index);
    fs::create_directories(dir);
  }
  workers_.resize(static_cast<size_t>(o_.nproc_per_node));
  for (int i = 0; i < o_.nproc_per_node; ++i) {
    Worker& w = workers_[static_cast<size_t>(i)];
    w.local_rank = i;
    w.rank = w_.node_rank * o_.nproc_per_node + i;
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
static bool is_backtrace_frame(std::string_view text) {
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
      // Regression (LeftoverSegmentOfAKilledRank): shared-memory segments the program made and
      // had no time to unlink (SIGKILL) stayed in /dev/shm until the machine restarted.
      shm::remove_segments_of(w.program_pid);
      if (!w.failed() && phase_ == Phase::kRunning && first_done_rank_ < 0) {
        first_done_rank_ = w.rank;  // Note [Exit barrier]: the others' time starts now
        first_done_ = w.exit_time;
      }
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
// once a second at most, and again when it goes on. Not every wait has a timeout: rank 0 serves
// the rendezvous store, and a peer's store request to a stopped rank 0 waits for its answer for
// good (regression StoppedStoreServerHeldItsPeersForever); when every worker left is stopped,
// nothing can time out at all. So past --stopped-timeout a stopped worker fails its group.
void Group::watch_stops() {
  if (Clock::now() < next_stop_check_) return;
  next_stop_check_ = Clock::now() + std::chrono::seconds(1);
  const Worker* longest = nullptr;
  for (auto& w : workers_) {
    if (w.exited) continue;
    const bool now = proc::is_stopped(w.program_pid);
    if (now && !w.signal_stopped) {
      spdlog::warn(
          "scaletrain run: rank {} (pid {}) is stopped by a signal; its peers wait for it until "
          "their collective timeout (--timeout), or --stopped-timeout {} s. `kill -CONT {}` lets "
          "it go on.",
          w.rank, w.program_pid, o_.stopped_timeout_s, w.program_pid);
      w.stopped_since = Clock::now();
    } else if (!now && w.signal_stopped) {
      spdlog::info("scaletrain run: rank {} (pid {}) goes on", w.rank, w.program_pid);
    }
    w.signal_stopped = now;
    if (now && (!longest || w.stopped_since < longest->stopped_since)) longest = &w;
  }
  if (!longest || phase_ != Phase::kRunning) return;
  const std::chrono::duration<double> stuck = Clock::now() - longest->stopped_since;
  if (stuck.count() < o_.stopped_timeout_s) return;
  stopped_out_ = fmt::format("rank {} (pid {}) was stopped by a signal for --stopped-timeout {} s",
                             longest->rank, longest->program_pid, o_.stopped_timeout_s);
  spdlog::error(
      "scaletrain run: {}: the group counts as failed (raise --stopped-timeout to hold a rank in "
      "a debugger longer)",
      stopped_out_);
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
  // The rendezvous forms a new world (Note [Elastic rendezvous]): what failed meanwhile most
  // likely failed because a peer left, so the group stops as recalled, not as failed.
  if (recall_ && !recalled_ && !stopped_by_signal_ && phase_ != Phase::kStopping && recall_()) {
    recalled_ = true;
    stop_running(SIGTERM);
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
    watch_exit_barrier();
    advance_teardown();
    bool all_exited = true;
    for (auto& w : workers_) all_exited = all_exited && w.exited;
    if (all_exited) break;
    poll_pipes(100);
  }
  finish_output();
  if (stopped_by_signal_) return report_interrupted();
  if (recalled_) return kRecalled;
  if (!stopped_out_.empty()) {
    const std::string msg =
        fmt::format("scaletrain run: worker group failed (attempt {} of {}): {}\n", w_.restarts + 1,
                    o_.max_restarts + 1, stopped_out_);
    [[maybe_unused]] auto n = write(STDERR_FILENO, msg.data(), msg.size());
    return 1;
  }
  if (stragglers_stopped_) return report_stragglers();
  if (const Worker* root = root_cause()) {
    report_failure(*root);
    return 1;
  }
  return 0;
}

SignalScope::SignalScope() {
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

SignalScope::~SignalScope() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
  sigaction(SIGCHLD, &old_chld_, nullptr);
  close(g_signal_pipe[0]);
  close(g_signal_pipe[1]);
  g_signal_pipe[0] = g_signal_pipe[1] = -1;
}

// Note [Descendants]: for one launch() the launcher is a child subreaper, so that what a worker
// leaves behind when it exits (a double fork, a `setsid` daemon outside its process group) is
// re-parented to the launcher (from the worker's guardian, Note [Guardian]) instead of to init.
// When an attempt ends, the launcher kills every process below itself but the children it had
// before launch() (and their subtrees): nothing a worker started outlives its attempt.
SubreaperScope::SubreaperScope() {
  int was = 0;
  prctl(PR_GET_CHILD_SUBREAPER, &was);
  was_ = was;
  prctl(PR_SET_CHILD_SUBREAPER, 1);
}

SubreaperScope::~SubreaperScope() { prctl(PR_SET_CHILD_SUBREAPER, was_); }

}  // namespace scaletrain::launch_detail
