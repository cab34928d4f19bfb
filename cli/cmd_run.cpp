// `scaletrain run`: the torchrun-compatible launcher (src/launch/launch.cpp does the work).

#include <sstream>

#include "commands.h"
#include "scaletrain/error.h"
#include "scaletrain/launch.h"

namespace scaletrain::cli {
namespace {

std::vector<int> parse_rank_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      out.push_back(std::stoi(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw UsageError("--ranks-filter '" + s + "': '" + item +
                       "' is not a rank; give comma-separated ranks, e.g. 0,3");
    }
  }
  return out;
}

}  // namespace

int parse_nproc_per_node(const std::string& value, int auto_value) {
  if (value == "auto") return auto_value;
  try {
    size_t used = 0;
    const int n = std::stoi(value, &used);
    if (used != value.size()) throw std::invalid_argument(value);
    return n;
  } catch (const std::exception&) {
    throw UsageError("--nproc-per-node '" + value +
                     "' is not a number or 'auto'; give the workers for this node, e.g. 2");
  }
}

// torchrun's --nnodes: N, or MIN:MAX (elastic when the ends differ). Sets nnodes (the most)
// and min_nodes.
void parse_nnodes(const std::string& value, LaunchOptions& o) {
  const auto colon = value.find(':');
  auto number = [&](const std::string& part) {
    size_t used = 0;
    int n = 0;
    try {
      n = std::stoi(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != part.size()) {
      throw UsageError("--nnodes '" + value +
                       "' is not a number of nodes (N, or MIN:MAX as "
                       "torchrun takes it), e.g. 2 or 1:4");
    }
    return n;
  };
  if (colon == std::string::npos) {
    o.nnodes = number(value);
    return;
  }
  o.min_nodes = number(value.substr(0, colon));
  o.nnodes = number(value.substr(colon + 1));
  if (o.min_nodes < 1 || o.min_nodes > o.nnodes) {
    throw UsageError("--nnodes " + value + ": give MIN:MAX with 1 <= MIN <= MAX, e.g. 1:4");
  }
  if (o.min_nodes == o.nnodes) o.min_nodes = 0;  // a fixed number of nodes
}

void add_run_command(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("run", kRunDescription);
  struct Args {
    LaunchOptions o;
    std::string nproc = "1";
    std::string nnodes = "1";
    std::string ranks_filter;
  };
  auto args = std::make_shared<Args>();
  auto& o = args->o;
  cmd->add_option("--nproc-per-node,--nproc_per_node", args->nproc,
                  "Workers on this node: a number, or 'auto' (one per GPU, else one per core)")
      ->capture_default_str();
  cmd->add_option("--nnodes", args->nnodes,
                  "Number of nodes: N, or MIN:MAX for an elastic job (the world is formed again "
                  "when a node leaves or joins)")
      ->capture_default_str();
  cmd->add_option("--rdzv-last-call,--rdzv_last_call", o.rdzv_last_call_s,
                  "Elastic: seconds to wait for more nodes once MIN have joined")
      ->capture_default_str();
  cmd->add_option("--node-timeout,--node_timeout", o.node_timeout_s,
                  "Elastic: seconds a node's launcher may be silent before it counts as gone")
      ->capture_default_str();
  cmd->add_option("--node-rank,--node_rank", o.node_rank, "This node's rank, 0 .. nnodes-1")
      ->capture_default_str();
  cmd->add_option("--master-addr,--master_addr", o.master_addr,
                  "Address of node 0, which hosts the rendezvous store")
      ->capture_default_str();
  cmd->add_option("--master-port,--master_port", o.master_port,
                  "Port of the rendezvous store; 0 picks a free one (single node)")
      ->capture_default_str();
  cmd->add_option("--max-restarts,--max_restarts", o.max_restarts,
                  "Restart the whole worker group up to this many times after a failure")
      ->capture_default_str();
  cmd->add_option("--run-id,--run_id", o.run_id,
                  "Job id checked at rendezvous (default: random on one node, 'none' on several)");
  cmd->add_option("--rdzv-timeout,--rdzv_timeout", o.rdzv_timeout_s,
                  "Seconds the workers wait for every rank at rendezvous (elastic: also the "
                  "launchers' wait to connect and to join a world, and the host's for the others "
                  "at the end)")
      ->capture_default_str();
  cmd->add_option("--log-dir,--log_dir", o.log_dir,
                  "Keep each rank's output in DIR/attempt_K/rank_R.{stdout,stderr}");
  cmd->add_option("--ranks-filter,--local-ranks-filter", args->ranks_filter,
                  "Show only these ranks' output on the terminal, e.g. 0 or 0,3");
  cmd->add_flag("--quiet", o.quiet, "Show no worker output on the terminal (logs are kept)");
  cmd->add_option("--grace-period", o.grace_period_s,
                  "Seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  cmd->add_option("--stopped-timeout", o.stopped_timeout_s,
                  "Seconds a worker may stay stopped by a signal (SIGSTOP, a debugger) before "
                  "its group counts as failed")
      ->capture_default_str();
  cmd->add_option("--exit-barrier-timeout", o.exit_barrier_timeout_s,
                  "Seconds the other workers may run once one has exited 0; then they are "
                  "stopped and the group fails, naming them (0: wait for ever)")
      ->capture_default_str();
  cmd->add_option("command", o.command, "The program and its arguments (after --)")->required();
  cmd->callback([args, &action] {
    action = [args] {
      LaunchOptions opts = args->o;
      opts.nproc_per_node =
          parse_nproc_per_node(args->nproc, args->nproc == "auto" ? auto_nproc_per_node() : 0);
      parse_nnodes(args->nnodes, opts);
      if (!args->ranks_filter.empty()) opts.show_ranks = parse_rank_list(args->ranks_filter);
      validate(opts);
      return launch(opts);
    };
  });
}

}  // namespace scaletrain::cli
