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
// process group. When the launcher dies, even by SIGKILL, the kernel sends the guardian
// SIGUSR2 (PR_SET_PDEATHSIG), and the guardian kills the whole group: the program and anything
// it started. Otherwise the guardian waits for the program and exits the way it did.
void on_launcher_death(int) { killpg(0, SIGKILL); }

int relay_exit_of(pid_t prog) {
  int status = 0;
  while (waitpid(prog, &status, 0) < 0) {
    if (errno != EINTR) return 126;
  }
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

// One worker process and what it printed.
struct Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;          // the guardian (Note [Guardian]), leader of the worker's group
  pid_t program_pid = -1;  // the program itself, the process the user knows
  int out_fd = -1;         // read ends of its stdout and stderr pipes
  int err_fd = -1;
  std::string out_partial, err_partial;
  std::deque<std::string> err_tail;
  std::unique_ptr<std::ofstream> out_log, err_log;
  bool exited = false;
  int status = 0;
  bool shown = true;
};

class Group {
 public:
  Group(const LaunchOptions& o, int attempt) : o_(o), attempt_(attempt) {}
  ~Group() { kill_all(SIGKILL); }

  void start();
  // Supervises until every worker exited. Returns 0 on success, else the launcher's status.
  int supervise();

 private:
  std::vector<std::string> worker_env(const Worker& w) const;
  void spawn(Worker& w);
  void drain(Worker& w, int fd, bool is_err, bool flush_all);
  void emit(Worker& w, const std::string& line, bool is_err);
  void reap();
  void kill_all(int sig);
  void report_failure(const Worker& w) const;

  const LaunchOptions& o_;
  int attempt_;
  std::vector<Worker> workers_;
  const Worker* culprit_ = nullptr;
  bool tearing_down_ = false;
  Clock::time_point kill_deadline_{};
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
  if (pid == 0) {
    // Child: the worker's guardian (Note [Guardian]). It leads the worker's own process group
    // (teardown signals the group whole) and dies with the launcher.
    setpgid(0, 0);
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGCHLD, SIG_DFL);
    signal(SIGINT, SIG_IGN);  // the group's SIGINT/SIGTERM are for the program
    signal(SIGTERM, SIG_IGN);
    signal(SIGUSR2, on_launcher_death);
    prctl(PR_SET_PDEATHSIG, SIGUSR2);
    if (getppid() != parent) on_launcher_death(SIGUSR2);
    pid_t prog = fork();
    if (prog == 0) {
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGUSR2, SIG_DFL);
      execvpe(argv[0], argv.data(), envp.data());
      dprintf(STDERR_FILENO, "cannot execute '%s': %s\n", argv[0], strerror(errno));
      _exit(127);
    }
    // Tell the launcher which pid the program has: that is the one its summary names.
    [[maybe_unused]] auto n = write(pid_pipe[1], &prog, sizeof(prog));
    close(pid_pipe[1]);
    _exit(prog < 0 ? 126 : relay_exit_of(prog));
  }
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
  w.out_fd = out[0];
  w.err_fd = err[0];
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
      w.out_log = std::make_unique<std::ofstream>(fmt::format("{}/rank_{}.stdout", dir, w.rank));
      w.err_log = std::make_unique<std::ofstream>(fmt::format("{}/rank_{}.stderr", dir, w.rank));
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

void Group::emit(Worker& w, const std::string& line, bool is_err) {
  if (is_err) {
    w.err_tail.push_back(line);
    while (static_cast<int>(w.err_tail.size()) > o_.tail_lines) w.err_tail.pop_front();
  }
  auto& log = is_err ? w.err_log : w.out_log;
  if (log) *log << line << '\n' << std::flush;
  if (w.shown) {
    std::string text = fmt::format("[rank{}]:{}\n", w.rank, line);
    [[maybe_unused]] auto n =
        write(is_err ? STDERR_FILENO : STDOUT_FILENO, text.data(), text.size());
  }
}

void Group::drain(Worker& w, int fd, bool is_err, bool flush_all) {
  std::string& partial = is_err ? w.err_partial : w.out_partial;
  char buf[8192];
  ssize_t n = read(fd, buf, sizeof(buf));
  if (n > 0) partial.append(buf, static_cast<size_t>(n));
  size_t pos;
  while ((pos = partial.find('\n')) != std::string::npos) {
    emit(w, partial.substr(0, pos), is_err);
    partial.erase(0, pos + 1);
  }
  if (n <= 0) {  // EOF (or error): flush what is left and stop watching this pipe
    if (!partial.empty() || flush_all) {
      if (!partial.empty()) emit(w, partial, is_err);
      partial.clear();
    }
    close(fd);
    (is_err ? w.err_fd : w.out_fd) = -1;
  }
}

void Group::reap() {
  int status = 0;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    for (auto& w : workers_) {
      if (w.pid != pid) continue;
      w.exited = true;
      w.status = status;
      bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
      if (failed && !tearing_down_) {
        culprit_ = &w;
        tearing_down_ = true;
        kill_deadline_ =
            Clock::now() + std::chrono::milliseconds(static_cast<long>(o_.grace_period_s * 1000));
        kill_all(SIGTERM);
      }
    }
  }
}

void Group::kill_all(int sig) {
  for (auto& w : workers_) {
    if (w.pid > 0 && !w.exited) killpg(w.pid, sig);
  }
}

int Group::supervise() {
  bool stopping_for_signal = false;
  while (true) {
    reap();
    int stop = g_stop_signal.load();
    if (stop != 0 && !stopping_for_signal) {
      stopping_for_signal = true;
      tearing_down_ = true;
      kill_deadline_ =
          Clock::now() + std::chrono::milliseconds(static_cast<long>(o_.grace_period_s * 1000));
      kill_all(stop);
    }
    if (tearing_down_ && Clock::now() > kill_deadline_) kill_all(SIGKILL);

    bool all_exited = true;
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, bool>> owners;
    for (auto& w : workers_) {
      all_exited &= w.exited;
      if (w.out_fd >= 0) fds.push_back({w.out_fd, POLLIN, 0}), owners.push_back({&w, false});
      if (w.err_fd >= 0) fds.push_back({w.err_fd, POLLIN, 0}), owners.push_back({&w, true});
    }
    // Done when every worker exited and its pipes hit EOF. A pipe a grandchild still holds open
    // would block EOF forever, so after exit give the pipes only a moment.
    if (all_exited && fds.empty()) break;
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    int timeout_ms = all_exited ? 200 : 100;
    int ready = poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) throw Error(fmt::format("poll failed: {}", strerror(errno)));
    if (ready == 0 && all_exited) {
      for (auto& w : workers_) {
        if (w.out_fd >= 0) close(w.out_fd), w.out_fd = -1;
        if (w.err_fd >= 0) close(w.err_fd), w.err_fd = -1;
      }
      break;
    }
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        drain(*owners[i].first, fds[i].fd, owners[i].second, false);
      }
    }
    if (fds.back().revents & POLLIN) {
      char buf[64];
      [[maybe_unused]] auto n = read(g_signal_pipe[0], buf, sizeof(buf));
    }
  }
  // A worker's own children may still run (a shell's background job ignores SIGINT): nothing
  // of a worker's process group outlives its attempt.
  for (auto& w : workers_) {
    if (w.pid > 0) killpg(w.pid, SIGKILL);
  }
  if (stopping_for_signal) {
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
  if (culprit_ != nullptr) {
    report_failure(*culprit_);
    return 1;
  }
  return 0;
}

void Group::report_failure(const Worker& w) const {
  std::string how = WIFSIGNALED(w.status)
                        ? fmt::format("was killed by {}", signal_name(WTERMSIG(w.status)))
                        : fmt::format("exited with code {}", WEXITSTATUS(w.status));
  std::string msg = fmt::format(
      "scaletrain run: worker group failed (attempt {} of {})\n"
      "  rank {} (local rank {}, node {}, pid {}) {}; the other workers were stopped.\n",
      attempt_ + 1, o_.max_restarts + 1, w.rank, w.local_rank, o_.node_rank,
      w.program_pid > 0 ? w.program_pid : w.pid, how);
  if (w.err_tail.empty()) {
    msg += "  it printed nothing on its error output.\n";
  } else {
    msg += fmt::format("  last {} lines of its error output:\n", w.err_tail.size());
    for (auto& line : w.err_tail) msg += "    " + line + "\n";
  }
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

}  // namespace

int pick_free_port() {
  int fd = net::bind_tcp(0, /*loopback_only=*/false, /*listen=*/false);
  int port = fd >= 0 ? net::bound_port(fd) : -1;
  if (fd >= 0) close(fd);
  if (port <= 0) throw Error(fmt::format("cannot find a free port: {}", strerror(errno)));
  return port;
}

int auto_nproc_per_node() {
  int gpus = 0;
  std::error_code ec;
  if (fs::is_directory("/proc/driver/nvidia/gpus", ec)) {
    for ([[maybe_unused]] auto& e : fs::directory_iterator("/proc/driver/nvidia/gpus", ec)) ++gpus;
  }
  if (const char* vis = std::getenv("CUDA_VISIBLE_DEVICES"); vis && gpus > 0) {
    std::string v = vis;
    gpus = v.empty() ? 0 : 1 + static_cast<int>(std::count(v.begin(), v.end(), ','));
  }
  if (gpus > 0) return gpus;
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
  for (int attempt = 0; attempt <= o.max_restarts; ++attempt) {
    spdlog::info(
        "scaletrain run: starting {} worker(s) on node {}/{} (world {}, master {}:{}, "
        "run '{}', attempt {} of {})",
        o.nproc_per_node, o.node_rank, o.nnodes, o.nproc_per_node * o.nnodes, o.master_addr,
        o.master_port, o.run_id, attempt + 1, o.max_restarts + 1);
    int status;
    {
      Group group(o, attempt);
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
