#include "launch/elastic.h"

#include <spdlog/spdlog.h>

#include <memory>

#include "launch/group.h"
#include "launch/proc_tree.h"
#include "launch/rendezvous.h"
#include "scaletrain/error.h"

namespace scaletrain::launch_detail {
namespace {

RendezvousOptions rendezvous_options(const LaunchOptions& o) {
  RendezvousOptions r;
  r.host = o.master_addr;
  r.port = o.master_port;
  r.run_id = o.run_id;
  r.nproc = o.nproc_per_node;
  r.min_nodes = o.min_nodes;
  r.max_nodes = o.nnodes;
  r.max_restarts = o.max_restarts;
  r.last_call_s = o.rdzv_last_call_s;
  r.node_timeout_s = o.node_timeout_s;
  r.join_timeout_s = o.rdzv_timeout_s;
  return r;
}

// What the launcher does when a round ended under its workers: 0 to join again, else its status.
int after_recall(RendezvousClient& client) {
  const std::string why = client.take_recall();
  if (why.rfind("RESTART", 0) == 0) {
    const auto at = why.find(' ', 8);
    spdlog::warn("scaletrain run: the world changes ({}): stopped the workers, joining again",
                 at == std::string::npos ? why : why.substr(at + 1));
    return 0;
  }
  spdlog::error("scaletrain run: {}", why.substr(why.find(' ') + 1));
  return 1;
}

// The host's launcher returns only once the other nodes of the last world have ended too (or
// --rdzv-timeout passed, or a signal came): its rendezvous is theirs.
struct HostStays {
  RendezvousServer* server;
  double timeout_s;
  ~HostStays() {
    if (server) server->wait_for_members(timeout_s, &g_stop_signal);
  }
};

// Rounds until the job ends; `client` is this node's connection to the rendezvous.
int run_rounds(const LaunchOptions& o, RendezvousClient& client) {
  const std::vector<pid_t> not_ours = proc::children_of_self();
  bool last_failed = false;
  while (true) {
    const Round r = client.join(o.nproc_per_node, pick_free_port());
    if (g_stop_signal.load() != 0) return 128 + g_stop_signal.load();
    if (r.kind == Round::kClosed) {
      spdlog::info("scaletrain run: {}", r.reason);
      return last_failed ? 1 : 0;  // this node's own last world failed: it says so
    }
    if (r.kind == Round::kAborted) {
      spdlog::error("scaletrain run: the job stops: {}", r.reason);
      return 1;
    }
    spdlog::info(
        "scaletrain run: round {}: node {} of {}, {} worker(s) (world {}, master {}:{}, run "
        "'{}', {} of {} restarts used)",
        r.round, r.node_rank, r.nnodes, o.nproc_per_node, o.nproc_per_node * r.nnodes,
        r.master_addr, r.master_port, o.run_id, r.restarts, o.max_restarts);
    // --log-dir's attempt_<k> is the round's number, the same on every node.
    GroupWorld world{r.node_rank, r.nnodes, r.master_addr, r.master_port, r.restarts, r.round};
    int status;
    {
      Group group(o, world, not_ours, [&client] { return client.recalled(); });
      group.start();
      status = group.supervise();
    }
    last_failed = status == 1;
    if (status == 0) {
      client.report_done();
      return 0;
    }
    if (status >= 128) return status;
    if (status == kRecalled) {
      if (const int s = after_recall(client); s != 0) return s;
      continue;
    }
    client.report_failed();  // the host counts it against --max-restarts
  }
}

}  // namespace

int launch_elastic(const LaunchOptions& o) {
  SignalScope signals;
  SubreaperScope subreaper;
  const RendezvousOptions ro = rendezvous_options(o);
  // The server outlives this node's client: declared first, destroyed last.
  std::unique_ptr<RendezvousServer> server = RendezvousServer::try_host(ro);
  if (server) {
    spdlog::info("scaletrain run: hosting the rendezvous on {}:{} ({} to {} nodes)", ro.host,
                 ro.port, ro.min_nodes, ro.max_nodes);
  }
  if (ro.host.rfind("127.", 0) == 0 || ro.host == "localhost") {
    spdlog::warn(
        "scaletrain run: --master-addr {} is this machine's loopback: only launchers of this "
        "machine meet there (on several machines, give the host's address)",
        ro.host);
  }
  HostStays stays{server.get(), o.rdzv_timeout_s};
  try {
    RendezvousClient client(ro, server != nullptr, &g_stop_signal);
    return run_rounds(o, client);
  } catch (const Error&) {
    if (g_stop_signal.load() != 0) return 128 + g_stop_signal.load();
    throw;
  }
}

}  // namespace scaletrain::launch_detail
