#include "scaletrain/launch.h"

#include <sys/resource.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "launch/elastic.h"
#include "launch/group.h"
#include "launch/net.h"
#include "runtime/proc_tree.h"
#include "scaletrain/error.h"
#include "scaletrain/secret.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using namespace launch_detail;

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

std::string random_run_id() {
  std::random_device rd;
  return fmt::format("{:08x}", rd());
}

}  // namespace

// Note [Store port]: a port the kernel hands out for bind(0) lies in the ephemeral range
// (ip_local_port_range), from which every outgoing connection of the machine also takes its
// local port, and Gloo's meshes make many. Between the pick and rank 0's listen (a process start
// and LibTorch's load, a second or more) another job's connection could take it, and rank 0
// failed with EADDRINUSE (regression StorePortTakenByAnOutgoingConnection, seen with two jobs at
// once). A port below the ephemeral range is never an outgoing connection's: one is drawn at
// random from the 8192 below it and checked to bind; bind(0) is the fallback.
int pick_free_port() {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  const int lo = std::max(1024, ephemeral_low - 8192), hi = ephemeral_low;  // [lo, hi)
  if (hi - lo >= 1024) {
    std::mt19937 gen(std::random_device{}());
    std::uniform_int_distribution<int> draw(lo, hi - 1);
    for (int i = 0; i < 64; ++i) {
      const int port = draw(gen);
      const int probe = net::bind_tcp(port, /*loopback_only=*/false, /*listen=*/false);
      if (probe >= 0) {
        close(probe);
        return port;
      }
    }
  }
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

bool is_elastic(const LaunchOptions& o) { return o.min_nodes > 0 && o.min_nodes < o.nnodes; }

// The elastic options (Note [Elastic rendezvous]).
void validate_elastic(const LaunchOptions& o) {
  if (o.min_nodes < 0 || o.min_nodes > o.nnodes) {
    throw UsageError(
        fmt::format("--nnodes {}:{}: give MIN:MAX with 1 <= MIN <= MAX", o.min_nodes, o.nnodes));
  }
  if (!is_elastic(o)) return;
  if (o.node_rank != 0) {
    throw UsageError(fmt::format(
        "--node-rank {} with --nnodes {}:{}: an elastic job's rendezvous numbers the nodes "
        "itself; leave --node-rank out",
        o.node_rank, o.min_nodes, o.nnodes));
  }
  if (!(o.rdzv_last_call_s >= 0) || !std::isfinite(o.rdzv_last_call_s)) {
    throw UsageError(
        fmt::format("--rdzv-last-call {} must be 0 or more seconds", o.rdzv_last_call_s));
  }
  if (!(o.node_timeout_s >= 1) || !std::isfinite(o.node_timeout_s)) {
    throw UsageError(
        fmt::format("--node-timeout {} must be 1 s or more (the launchers beat every 0.5 s)",
                    o.node_timeout_s));
  }
}

// Note [Job secret]: a job of one node makes its own; the nodes of a job of several must share
// one, which none of them can make for the others.
void resolve_secret(LaunchOptions& o) {
  if (o.secret.empty()) o.secret = user_secret();
  if (!o.secret.empty()) {
    if (o.secret.size() < kMinSecretLength) {
      throw UsageError(fmt::format("LaunchOptions::secret holds {} characters, fewer than {}",
                                   o.secret.size(), kMinSecretLength));
    }
    return;
  }
  if (o.nnodes > 1) {
    throw UsageError(fmt::format(
        "--nnodes {}: the nodes of a job prove to each other that they belong to it with a "
        "shared secret, and none was given. Set {}=PATH on every node (a file only you may "
        "read; made with a new secret where missing, so on a shared file system one path is "
        "enough), or {} (docs/launcher.md, \"Threat model\")",
        o.min_nodes > 0 && o.min_nodes < o.nnodes ? fmt::format("{}:{}", o.min_nodes, o.nnodes)
                                                  : std::to_string(o.nnodes),
        kSecretFileEnv, kSecretEnv));
  }
  o.secret = generate_secret();
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
  validate_elastic(o);
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
  if (!(o.exit_barrier_timeout_s >= 0) || !std::isfinite(o.exit_barrier_timeout_s)) {
    throw UsageError(fmt::format(
        "--exit-barrier-timeout {} must be 0 (wait for ever) or more seconds: how long the "
        "other workers may run once one has exited 0",
        o.exit_barrier_timeout_s));
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
  } else if (o.node_rank == 0 && !is_elastic(o) && !port_is_free(o.master_port)) {
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
  resolve_secret(o);
  for (int r : o.show_ranks) {
    if (r < 0 || r >= o.nproc_per_node * o.nnodes) {
      throw UsageError(fmt::format("rank {} given to show is outside the world of {} ranks", r,
                                   o.nproc_per_node * o.nnodes));
    }
  }
}

int launch(const LaunchOptions& o) {
  raise_file_limit(o);
  if (is_elastic(o)) return launch_elastic(o);
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
      GroupWorld world{o.node_rank, o.nnodes, o.master_addr, o.master_port, attempt, attempt};
      Group group(o, world, not_ours);
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
