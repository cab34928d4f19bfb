#include "launch/elastic.h"

#include <spdlog/spdlog.h>

#include <memory>

#include "launch/group.h"
#include "launch/rendezvous.h"
#include "runtime/proc_tree.h"
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
  r.secret = o.secret;
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

// Note [Cut-off node]: a node that hears nothing from the rendezvous host for --node-timeout is
// cut off by the network (a closed connection means the host's launcher ended instead). It stops
// its workers, as every node of a round that ends does, and then connects again, retrying until
// --rdzv-timeout: once the network is back it joins as a node that comes (the world grows again
// if it has room) and its workers resume from the newest checkpoint. The host does the same as
// for any node: it counted the node as gone after --node-timeout, and neither the leave nor the
// join counts against --max-restarts. The host's own node is never cut off from its rendezvous.
std::unique_ptr<RendezvousClient> reconnect(std::unique_ptr<RendezvousClient> old,
                                            const RendezvousOptions& ro, const std::string& why) {
  spdlog::warn(
      "scaletrain run: {}: stopped the workers; connecting to the rendezvous again (for up to "
      "{:.0f} s, --rdzv-timeout)",
      why, ro.join_timeout_s);
  old.reset();  // closes the connection the host may still hold
  try {
    auto client = std::make_unique<RendezvousClient>(ro, false, &g_stop_signal, true);
    spdlog::info("scaletrain run: reached the rendezvous {}:{} again: joining", ro.host, ro.port);
    return client;
  } catch (const Error& e) {
    throw Error(std::string("this node was cut off from the rendezvous host and ") + e.what());
  }
}

// Rounds until the job ends.
int run_rounds(const LaunchOptions& o, const RendezvousOptions& ro, bool hosting) {
  const std::vector<pid_t> not_ours = proc::children_of_self();
  bool last_failed = false;
  auto client = std::make_unique<RendezvousClient>(ro, hosting, &g_stop_signal);
  while (true) {
    Round r;
    try {
      r = client->join(o.nproc_per_node, pick_free_port());
    } catch (const Error& e) {
      if (hosting || !client->cut_off() || g_stop_signal.load() != 0) throw;
      std::string why = e.what();  // cut off while joining
      const std::string prefix = "scaletrain run: ";
      if (why.rfind(prefix, 0) == 0) why = why.substr(prefix.size());
      client = reconnect(std::move(client), ro, why);
      continue;
    }
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
      RendezvousClient& c = *client;
      Group group(o, world, not_ours, [&c] { return c.recalled(); });
      group.start();
      status = group.supervise();
    }
    last_failed = status == 1;
    if (status == 0) {
      client->report_done();
      return 0;
    }
    if (status >= 128) return status;
    if (status == kRecalled && !hosting && client->cut_off()) {
      const std::string abort = client->take_recall("ABORT");  // queued before the cut
      if (!abort.empty()) {
        spdlog::error("scaletrain run: {}", abort.substr(abort.find(' ') + 1));
        return 1;
      }
      const std::string why = client->take_recall("LOST");
      client = reconnect(std::move(client), ro, why.substr(why.find(' ') + 1));
      continue;
    }
    if (status == kRecalled) {
      if (const int s = after_recall(*client); s != 0) return s;
      continue;
    }
    client->report_failed();  // the host counts it against --max-restarts
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
    return run_rounds(o, ro, server != nullptr);
  } catch (const Error&) {
    if (g_stop_signal.load() != 0) return 128 + g_stop_signal.load();
    throw;
  }
}

}  // namespace scaletrain::launch_detail
