#pragma once
// Note [Heartbeats] (internal). Every process of a world of several beats: rank 0 serves a
// small TCP endpoint of its own (its port published in the job's store), every other rank
// connects to it and sends a byte every interval from a thread of its own. A collective that
// times out then asks which ranks stopped answering: rank 0 knows when it last heard from each
// rank; another rank asks rank 0 over a fresh connection. A process stopped by SIGSTOP, frozen,
// or cut off from the network stops beating and is named, with its host and pid; a rank that is
// alive but waits elsewhere (another code path) goes on beating and is not. When rank 0 itself
// is the one stopped, its endpoint does not answer, and that is what the report says. The
// times are rank 0's own clock: the hosts' clocks need not agree. Not the store: its client
// logs every failed operation with a backtrace, which a beat after rank 0's normal exit would
// print.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/world.h"

namespace scaletrain {

class Heartbeat {
 public:
  /// Rank 0 starts serving and publishes its port in `store`; another rank reads the port
  /// (waiting for it as the store waits) and starts beating every `interval`.
  Heartbeat(const World& world, c10d::Store& store, std::chrono::milliseconds interval);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  /// The ranks that stopped beating, as a clause ("not answering: rank 1 (host a, pid 12) did
  /// not beat for 3.2 s ..."), or "" when every rank beats. Never throws, never waits more than
  /// a few seconds: rank 0 not answering is itself reported.
  std::string silent_ranks() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Peer {
    std::string who;  // "host h, pid p"; empty before its hello
    Clock::time_point last{};
    bool left = false;  // its connection closed
  };
  void serve();
  void beat();
  std::string report() const;

  World world_;
  std::chrono::milliseconds interval_;
  int port_ = -1;
  int listener_ = -1, wake_[2] = {-1, -1};  // rank 0
  int connection_ = -1;                     // the others
  mutable std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::vector<Peer> peers_;  // rank 0: by rank
  std::thread thread_;
};

}  // namespace scaletrain
