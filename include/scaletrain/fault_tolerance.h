#pragma once
// Fault-tolerant replicas (TorchFT's design, Note [Replica groups] in
// src/dist/fault_tolerance.cpp): the data-parallel dimension is made of replica groups, each a
// job of its own (its own launcher, world and restarts). Every step the live replicas agree on a
// quorum through a lighthouse, a small process outside every replica; a replica that fails is
// left out of the next quorum and the others go on with the gradient averaged over the live ones;
// a replica that starts again resumes from its own newest checkpoint, then receives the live
// weights, optimizer and data position from a peer and joins at a step boundary.
//
//   lighthouse:  scaletrain lighthouse --port 29510            (or serve_lighthouse())
//   replica r:   scaletrain run --nproc-per-node 2 --max-restarts 100 --
//                  scaletrain train --fault-tolerant --lighthouse HOST:29510 --replica-id r ...
//
// A user's loop: one ReplicaGroup per process; per step quorum(), then, where it says so,
// share_state(); then forward, backward (and the replica's own DDP), all_reduce() of the
// gradients, and commit() before the optimizer's step.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/dist.h"

namespace scaletrain {

struct LighthouseOptions {
  /// The interface it listens on: "0.0.0.0" every one, "127.0.0.1" this machine alone, or one
  /// address of this machine.
  std::string host = "0.0.0.0";
  int port = 29510;  // 0: a free one (printed, and given to `on_listening`)
  /// A quorum needs this many replicas; fewer wait.
  int min_replicas = 1;
  /// A replica whose beats stopped this long ago is gone (killed, stopped, cut off).
  std::chrono::milliseconds heartbeat_timeout{1500};
  /// How long a quorum waits for a member of the previous one that still beats but has not
  /// asked (a slow step); past it, the quorum forms without it (it joins again later). The
  /// first quorum waits this long for every replica to start.
  std::chrono::milliseconds join_timeout{5000};
  /// The replicas the job starts with (0: not known): the first quorum forms as soon as that
  /// many have asked, instead of waiting join_timeout out.
  int replicas = 0;
  /// Called once the store listens, with the port.
  std::function<void(int)> on_listening;
  /// Each quorum that changes the membership, in words ("quorum 3: replicas 0, 1; ...").
  std::function<void(const std::string&)> on_quorum;
  /// The job's secret (secret.h): a connection that does not prove it is closed before
  /// anything it says is read. Empty: the user's (SCALETRAIN_SECRET, SCALETRAIN_SECRET_FILE);
  /// with none, serve_lighthouse() throws UsageError.
  std::string secret;
  /// Refused connections, in a line every few seconds at most ("refused 3 connections, the
  /// first from 10.0.0.7 (wrong secret)"). Unset: the library's log (warn).
  std::function<void(const std::string&)> on_refused;
};

/// Serves the lighthouse until `stop` becomes true (or forever where it is null; `stop` is read
/// at least every 25 ms, so a signal handler that sets it is answered at once). Throws Error
/// when the port cannot be had, UsageError without a secret.
void serve_lighthouse(const LighthouseOptions& options, const std::atomic<bool>* stop = nullptr);

/// serve_lighthouse() on a thread of its own, for a program that hosts its replicas' lighthouse
/// itself: the constructor returns once it listens (or throws what serve_lighthouse threw), the
/// destructor stops it and waits for its thread. `options.on_listening` is its own.
class LighthouseThread {
 public:
  explicit LighthouseThread(LighthouseOptions options);
  ~LighthouseThread();
  LighthouseThread(const LighthouseThread&) = delete;
  LighthouseThread& operator=(const LighthouseThread&) = delete;

  int port() const { return port_; }
  /// "HOST:PORT" for ReplicaGroupOptions::lighthouse (127.0.0.1 where it listens on 0.0.0.0).
  std::string address() const;

 private:
  std::string host_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

struct ReplicaGroupOptions {
  std::string lighthouse = "127.0.0.1:29510";  // HOST:PORT
  int replica_id = 0;                          // 0, 1, ...: this replica's name at the lighthouse
  /// A collective between replicas (and the making of their group) that waits longer fails: the
  /// step is not committed and the next quorum leaves the silent replica out.
  std::chrono::milliseconds timeout{10000};
  /// How long quorum() waits for the lighthouse's answer (min_replicas live replicas). The
  /// replica's other ranks wait for rank 0's answer under the replica's own collective timeout,
  /// so keep that at least as long (the trainer's --timeout; the command line ties them).
  std::chrono::milliseconds quorum_timeout{std::chrono::minutes(2)};
  /// What every replica of the job must share (the trainer gives its seed, batch size, data
  /// size and epochs; the ranks per replica are added): the lighthouse refuses a replica whose
  /// settings differ from the first one's, naming both, instead of training other samples.
  std::string fingerprint;
  /// Rank 0 of each replica beats at the lighthouse this often.
  std::chrono::milliseconds beat_interval{100};
  /// The job's secret, the lighthouse's (LighthouseOptions::secret). Empty: the user's
  /// (SCALETRAIN_SECRET, SCALETRAIN_SECRET_FILE); with none, ReplicaGroup throws UsageError.
  std::string secret;
};

/// One quorum: the live replicas of this step.
struct Quorum {
  int64_t id = 0;              // changes when the membership does
  std::vector<int> replicas;   // sorted replica ids
  std::vector<int64_t> steps;  // each one's step when it asked, by position in `replicas`
  int slot = 0;                // this replica's position in `replicas`
  int64_t max_step = 0;        // the furthest step among them
  int donor = 0;               // position of the replica that shares its state (at max_step)
  /// Some replica is behind max_step: share_state() is due (every member calls it).
  bool heal = false;
  /// This replica is behind and takes the donor's state.
  bool recovering = false;
  /// The other replicas finished the run at this step while this one was behind (-1: not
  /// finished): nothing is left to train here, and no peer is left to heal it.
  int64_t finished_at = -1;
  int size() const { return static_cast<int>(replicas.size()); }
};

/// This process's part in the fault-tolerant replicas (TorchFT's Manager). `replica` is the
/// replica's own world (init_process_group's); its rank k talks to rank k of the other replicas.
class ReplicaGroup {
 public:
  ReplicaGroup(const Dist& replica, ReplicaGroupOptions options);
  ~ReplicaGroup();
  ReplicaGroup(const ReplicaGroup&) = delete;
  ReplicaGroup& operator=(const ReplicaGroup&) = delete;

  /// Collective over the replica: asks the lighthouse for this step's quorum (rank 0 asks, the
  /// others are told), and makes the group between replicas when the membership changed.
  /// `step`: this replica's committed steps. Throws Error naming the lighthouse when it does
  /// not answer within quorum_timeout.
  Quorum quorum(int64_t step);
  /// Every member calls it when quorum().heal (collective over the replica too): the donor's
  /// `mine()` (bytes) reaches the others (returned where recovering, undefined elsewhere). False
  /// on every rank of the replica when the transfer failed on one (a member left): nothing is to
  /// be trusted, ask for a quorum again.
  bool share_state(const std::function<at::Tensor()>& mine, at::Tensor* received);
  /// In place: `tensor` summed over the quorum's replicas (this rank's counterpart in each).
  /// False when a replica failed during it; `tensor` is then garbage.
  bool all_reduce(at::Tensor& tensor);
  /// Collective over the replica: whether every rank's exchanges of this step succeeded (a
  /// step is committed, its optimizer step taken, only then). After a false one, the next
  /// quorum makes a new group.
  bool commit(bool mine);
  /// Collective over the replica, after its last step: says so at the lighthouse, so that a
  /// replica restarted later, behind, stops instead of training the rest alone.
  void finished(int64_t step);
  /// The current quorum's size (1 before the first).
  int live() const;
  const ReplicaGroupOptions& options() const { return options_; }

 private:
  std::string ask(int64_t step);
  [[noreturn]] void refused(const std::string& answer) const;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  ReplicaGroupOptions options_;
};

/// "host:port" → (host, port); throws UsageError naming `what` otherwise.
std::pair<std::string, int> parse_host_port(const std::string& value, const std::string& what);

}  // namespace scaletrain
