#pragma once
// The launcher behind `scaletrain run`: starts the workers of one node, gives each the
// environment torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), prefixes and keeps their output, and tears the
// whole group down as soon as one worker fails.
//
// Contract: launch() blocks until every worker has exited; no worker, nor any process a worker
// started, outlives it (each worker gets SIGKILL when the launcher dies, via PR_SET_PDEATHSIG,
// and lives in its own process group, which teardown signals; for its duration the calling
// process is a child subreaper, and when an attempt ends every process below it is killed but
// the children it had before the call). Not thread-safe: it installs SIGINT/SIGTERM/SIGCHLD
// handlers for its duration and restores the old ones afterwards.

#include <string>
#include <vector>

namespace scaletrain {

struct LaunchOptions {
  std::vector<std::string> command;  // the program and its arguments
  int nproc_per_node = 1;            // workers on this node
  int nnodes = 1;                    // with min_nodes: the most nodes
  int node_rank = 0;                 // fixed worlds only: an elastic round gives each node its rank
  // Elastic membership (torchrun's --nnodes MIN:MAX) when 0 < min_nodes < nnodes: the launchers
  // meet at master_addr:master_port, where the one whose machine holds that address hosts the
  // rendezvous (it must stay for the job's length). A world is formed from the nodes there once
  // min_nodes have joined (at once when nnodes have, else after rdzv_last_call_s), and formed
  // again whenever a node leaves (closes its connection, or is silent node_timeout_s), a node's
  // workers fail (counted against max_restarts) or a node joins while there is room; the workers
  // are then restarted at the new world size (a trainer resumes from its newest checkpoint).
  int min_nodes = 0;
  double rdzv_last_call_s = 3;
  double node_timeout_s = 10;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0: pick a free port (single node only)
  int max_restarts = 0;     // restart the failed group as a whole up to this many times
  std::string run_id;       // empty: random on one node, "none" on several
  // The job's secret (secret.h): the workers' store and the elastic rendezvous accept only
  // processes that prove it, and the workers get it in SCALETRAIN_WORLD_SECRET. Empty: the
  // user's (SCALETRAIN_SECRET, SCALETRAIN_SECRET_FILE), else a new one on a job of one node; the
  // nodes of a job of several must share one, and are refused without it.
  std::string secret;
  double rdzv_timeout_s = 300;  // passed to workers as SCALETRAIN_RDZV_TIMEOUT
  std::string log_dir;          // when set: <log_dir>/attempt_<k>/rank_<r>.{stdout,stderr}
  std::vector<int> show_ranks;  // ranks whose output reaches the terminal; empty: all
  bool quiet = false;           // show no worker output at all (logs are still kept)
  double grace_period_s = 5;    // SIGTERM, then SIGKILL after this long
  // A worker stopped by a signal (SIGSTOP, a debugger) for this long fails its group (restarted
  // where restarts are left): its peers may wait on it where no timeout reaches (a store request
  // to rank 0, which serves the store), and with every worker stopped nothing times out at all.
  double stopped_timeout_s = 300;
  int tail_lines = 20;  // error-output lines quoted in the failure summary (512 B each)
  // Once a worker has exited 0, the others get this long to exit too; those still running then
  // are stopped (SIGTERM, SIGKILL after grace_period_s) and the group fails, naming them (Note
  // [Exit barrier] in src/launch/group_exit.cpp). A rank that hangs after its peers finished
  // would otherwise hold the job for good. 0: wait for them for ever (torchrun's behaviour).
  double exit_barrier_timeout_s = 300;
};

/// The most workers one launcher starts on a node. Each worker is two processes (the program and
/// its guardian) and two pipes; a count past this is a typo, not a job.
constexpr int kMaxWorkersPerNode = 1024;

/// Checks the options and resolves the automatic ones (free port, run id, secret). Throws
/// UsageError naming the bad value and the fix: nproc < 1 or > kMaxWorkersPerNode, more workers
/// than this process may open files or start processes for, node_rank >= nnodes, a busy port, a
/// program that does not exist, a negative grace period or exit barrier timeout, several nodes
/// without a secret... Starts nothing.
void validate(LaunchOptions& options);

/// Runs the job (validate() first). Returns the launcher's exit status: 0 when every worker
/// of some attempt exited 0; 1 when the group failed more than max_restarts times; 128+N when
/// the launcher itself got signal N (SIGINT/SIGTERM are acted on at any moment, while workers
/// are still being started too: the started ones are stopped and no more are started).
int launch(const LaunchOptions& options);

/// What `--nproc-per-node auto` means, in every command: one worker per visible NVIDIA GPU
/// (when `use_gpus` and there are any), else one per CPU core, at most 8.
int auto_nproc_per_node(bool use_gpus = true);

/// A TCP port that was free on this host a moment ago: below the ephemeral range
/// (ip_local_port_range) where there is room, so that no outgoing connection takes it before the
/// store listens (Note [Store port] in src/launch/launch.cpp).
int pick_free_port();

}  // namespace scaletrain
