// `scaletrain lighthouse`: the process that forms the quorum of fault-tolerant replicas every
// step (fault_tolerance.h, Note [Replica groups]). It runs until SIGINT or SIGTERM, and hears
// only processes that prove the job's secret (SCALETRAIN_SECRET_FILE or SCALETRAIN_SECRET).

#include <signal.h>

#include <atomic>
#include <chrono>
#include <iomanip>
#include <iostream>

#include "commands.h"
#include "scaletrain/error.h"
#include "scaletrain/fault_tolerance.h"

namespace scaletrain::cli {
namespace {

std::atomic<bool> g_stop{false};

void on_signal(int) { g_stop = true; }

}  // namespace

void add_lighthouse_command(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("lighthouse", kLighthouseDescription);
  struct Args {
    LighthouseOptions o;
    double heartbeat_timeout = 1.5, join_timeout = 5;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--host", a->o.host,
                  "Interface to listen on: 0.0.0.0 every one, 127.0.0.1 this machine alone, or "
                  "one address of this machine")
      ->capture_default_str();
  cmd->add_option("--port", a->o.port, "Port to listen on (0: a free one, printed)")
      ->capture_default_str();
  cmd->add_option("--min-replicas", a->o.min_replicas,
                  "Replicas a quorum needs; with fewer alive, the replicas wait")
      ->capture_default_str();
  cmd->add_option("--replicas", a->o.replicas,
                  "Replicas the job starts with: the first quorum forms once they all asked (0: "
                  "it waits --join-timeout)")
      ->capture_default_str();
  cmd->add_option("--heartbeat-timeout", a->heartbeat_timeout,
                  "Seconds without a beat after which a replica is gone")
      ->capture_default_str();
  cmd->add_option("--join-timeout", a->join_timeout,
                  "Seconds a quorum waits for a live member of the last one that has not asked")
      ->capture_default_str();
  cmd->callback([a, &action] {
    action = [a] {
      if (!(a->heartbeat_timeout > 0) || !(a->join_timeout > 0)) {
        throw UsageError("--heartbeat-timeout and --join-timeout must be above 0 seconds");
      }
      if (a->o.port < 0 || a->o.port > 65535) {
        throw UsageError("--port " + std::to_string(a->o.port) + " must be 0 to 65535");
      }
      a->o.heartbeat_timeout =
          std::chrono::milliseconds(static_cast<int64_t>(a->heartbeat_timeout * 1000));
      a->o.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(a->join_timeout * 1000));
      a->o.on_listening = [](int port) {
        std::cout << "lighthouse: listening on port " << port << std::endl;
      };
      a->o.on_refused = [](const std::string& what) {
        std::cout << "lighthouse: " << what << std::endl;
      };
      const auto t0 = std::chrono::steady_clock::now();
      a->o.on_quorum = [t0](const std::string& what) {
        const std::chrono::duration<double> t = std::chrono::steady_clock::now() - t0;
        std::cout << "lighthouse: " << std::fixed << std::setprecision(3) << t.count()
                  << " s: " << what << std::endl;
      };
      struct sigaction sa {};
      sa.sa_handler = on_signal;
      sigaction(SIGINT, &sa, nullptr);
      sigaction(SIGTERM, &sa, nullptr);
      serve_lighthouse(a->o, &g_stop);
      return 0;
    };
  });
}

}  // namespace scaletrain::cli
