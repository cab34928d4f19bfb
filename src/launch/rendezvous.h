#pragma once
// The elastic launchers' rendezvous (internal, not public API; Note [Elastic rendezvous] in
// rendezvous.cpp): a small line protocol over TCP between the launchers of a `--nnodes MIN:MAX`
// job. One launcher hosts the RendezvousServer; every launcher, the host's included, talks to it
// through a RendezvousClient. Neither needs LibTorch.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace scaletrain::launch_detail {

/// Both sides send a line at least this often; a side silent for node_timeout_s is gone.
constexpr double kRendezvousBeatSeconds = 0.5;

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

struct RendezvousOptions {
  std::string host = "127.0.0.1";  // where the server listens / the clients connect
  int port = 29500;
  std::string run_id = "none";  // every launcher must give the same
  int nproc = 0;                // the host's --nproc-per-node: every node's must equal it
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;         // failed rounds allowed (the host's value counts)
  double last_call_s = 3;       // once min_nodes are there, wait this long for more (up to max)
  double node_timeout_s = 10;   // a launcher silent this long has left (beats every 0.5 s)
  double join_timeout_s = 300;  // a join that forms no round within this long fails
  std::string secret;           // the job's: every launcher proves it (Note [Job secret])
};

/// The server, on a thread of its own. Contract: a round is formed from the nodes that have
/// joined once min_nodes have (at once when max_nodes have, else after last_call_s), and never
/// while a member of the last round is still connected and has not joined again (its workers may
/// still be stopping); the host's own node is node 0 (so rank 0, which writes checkpoints, stays
/// on the node that must stay), the others follow in their order of first connection. A round
/// ends (every member is told to restart) when a member leaves, fails, or a node joins while
/// there is room. Failures count against max_restarts, leaves and joins do not; a failure reported
/// within a second of a member's leaving counts as the leave's consequence.
class RendezvousServer {
 public:
  /// Listens on options.host:options.port. Returns nullptr when this machine cannot (the address
  /// is another machine's, or another launcher here hosts it already).
  static std::unique_ptr<RendezvousServer> try_host(const RendezvousOptions& options);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  /// Waits (at most `timeout_s`, and not once `stop` is set) until every member of the last
  /// round said it is done or left.
  void wait_for_members(double timeout_s, const std::atomic<int>* stop = nullptr);
  int rounds_formed() const { return rounds_.load(); }

  struct State;  // the server thread's own (rendezvous.cpp)

 private:
  RendezvousServer(const RendezvousOptions& options, int listener);
  void serve();
  int listener_ = -1;
  int wake_[2] = {-1, -1};
  std::unique_ptr<State> state_;  // holds the Doorman of listener_
  std::atomic<bool> stop_{false};
  std::atomic<int> rounds_{0};
  std::atomic<int> members_busy_{0};
  std::thread thread_;
};

/// What a join ends in.
struct Round {
  enum Kind { kFormed, kClosed, kAborted } kind = kFormed;
  int round = 0;
  int node_rank = 0;
  int nnodes = 0;
  std::string master_addr;  // the workers' store: node 0's address and port
  int master_port = 0;
  int restarts = 0;    // failed rounds so far
  std::string reason;  // kClosed / kAborted: why
};

/// One launcher's connection to the server. A thread of its own beats every 0.5 s and reads what
/// the server says; a server silent for node_timeout_s (or a closed connection) counts as lost.
class RendezvousClient {
 public:
  /// Connects, retrying until join_timeout_s. Throws Error naming the address when it cannot.
  /// `hosting`: this launcher hosts the server; its node is then node 0 of every round it is in.
  /// `refused_is_final`: a host that refuses the connection (no launcher listens there) is an
  /// error at once, not waited for (a node cut off while the job ended).
  explicit RendezvousClient(const RendezvousOptions& options, bool hosting = false,
                            const std::atomic<int>* stop_signal = nullptr,
                            bool refused_is_final = false);
  ~RendezvousClient();
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  /// Joins the next round with `nproc` workers whose store would listen on `port` when this node
  /// is node 0. Blocks until a round is formed, the job is closed or aborted; throws Error on a
  /// refusal, a lost server, a timeout (naming how many nodes were there) or a stop signal.
  Round join(int nproc, int port);
  /// Whether the current round has ended (a restart, an abort or a lost server is waiting).
  bool recalled();
  /// Why: the message that ended the round ("RESTART <reason>", "ABORT <reason>", "LOST <why>"),
  /// the first one queued, or the first whose verb is `verb`; "" when there is none.
  std::string take_recall(const std::string& verb = "");
  void report_failed();
  void report_done();
  /// Whether the connection was lost to the network: nothing heard for node_timeout_s, or the
  /// host dropped this node for its silence (DROPPED); not closed by the host's launcher ending.
  bool cut_off() const { return cut_off_; }

 private:
  int connect_proved(std::string* why);
  void run();
  void send_line(const std::string& line);
  RendezvousOptions o_;
  std::string early_;  // what the host sent right after its proof (run() reads it first)
  bool hosting_;
  const std::atomic<int>* stop_signal_;
  int fd_ = -1;
  int wake_[2] = {-1, -1};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> inbox_;
  std::mutex send_mu_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cut_off_{false};
  std::thread thread_;
};

}  // namespace scaletrain::launch_detail
