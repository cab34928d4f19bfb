#include "scaletrain/world.h"

#include <cstdlib>
#include <sstream>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

// Parses an integer environment variable; throws UsageError naming it when malformed.
std::optional<long> env_int(const EnvLookup& env, const std::string& name) {
  auto v = env(name);
  if (!v || v->empty()) return std::nullopt;
  char* end = nullptr;
  long x = std::strtol(v->c_str(), &end, 10);
  if (*end != '\0') {
    throw UsageError("environment variable " + name + "='" + *v +
                     "' is not an integer; unset it or give a whole number");
  }
  return x;
}

int need_int(const EnvLookup& env, const std::string& name, int fallback) {
  auto v = env_int(env, name);
  return v ? static_cast<int>(*v) : fallback;
}

// Slurm's tasks-per-node forms: "4", "2(x3),1" -> first count.
int first_count(const std::string& s) { return std::atoi(s.c_str()); }

void read_torchrun(const EnvLookup& env, World& w) {
  w.source = "torchrun";
  w.rank = need_int(env, "RANK", 0);
  w.world_size = need_int(env, "WORLD_SIZE", 1);
  w.local_rank = need_int(env, "LOCAL_RANK", w.rank);
  w.local_world_size = need_int(env, "LOCAL_WORLD_SIZE", w.world_size);
  w.node_rank = need_int(env, "GROUP_RANK", need_int(env, "NODE_RANK", 0));
  w.num_nodes = need_int(env, "SCALETRAIN_NNODES",
                         w.local_world_size > 0 ? w.world_size / w.local_world_size : 1);
}

void read_slurm(const EnvLookup& env, World& w) {
  w.source = "slurm";
  w.rank = need_int(env, "SLURM_PROCID", 0);
  w.world_size = need_int(env, "SLURM_NTASKS", 1);
  w.local_rank = need_int(env, "SLURM_LOCALID", 0);
  w.node_rank = need_int(env, "SLURM_NODEID", 0);
  w.num_nodes = need_int(env, "SLURM_NNODES", need_int(env, "SLURM_JOB_NUM_NODES", 1));
  if (auto t = env("SLURM_STEP_TASKS_PER_NODE")) {
    w.local_world_size = first_count(*t);
  } else if (auto t2 = env("SLURM_TASKS_PER_NODE")) {
    w.local_world_size = first_count(*t2);
  } else {
    w.local_world_size = w.num_nodes > 0 ? w.world_size / w.num_nodes : w.world_size;
  }
  auto nodelist = env("SLURM_STEP_NODELIST");
  if (!nodelist) nodelist = env("SLURM_JOB_NODELIST");
  if (nodelist && !nodelist->empty()) w.master_addr = first_host_of_nodelist(*nodelist);
  if (auto job = env_int(env, "SLURM_JOB_ID")) {
    w.master_port = 29500 + static_cast<int>(*job % 1000);
    w.run_id = "slurm-" + std::to_string(*job);
  }
}

void read_mpi(const EnvLookup& env, World& w, const std::string& prefix) {
  if (prefix == "OMPI_COMM_WORLD_") {
    w.source = "openmpi";
    w.rank = need_int(env, "OMPI_COMM_WORLD_RANK", 0);
    w.world_size = need_int(env, "OMPI_COMM_WORLD_SIZE", 1);
    w.local_rank = need_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    w.local_world_size = need_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", w.world_size);
  } else {
    w.source = "pmi";
    w.rank = need_int(env, "PMI_RANK", 0);
    w.world_size = need_int(env, "PMI_SIZE", 1);
    w.local_rank = need_int(env, "MPI_LOCALRANKID", 0);
    w.local_world_size = need_int(env, "MPI_LOCALNRANKS", w.world_size);
  }
  if (w.local_world_size > 0) {
    w.num_nodes = (w.world_size + w.local_world_size - 1) / w.local_world_size;
    w.node_rank = w.rank / w.local_world_size;
  }
}

void check(const World& w) {
  auto bad = [&](const std::string& what) {
    throw UsageError("inconsistent " + w.source + " environment: " + what);
  };
  if (w.world_size < 1) {
    bad("world size " + std::to_string(w.world_size) + " must be at least 1");
  }
  if (w.rank < 0 || w.rank >= w.world_size) {
    bad("rank " + std::to_string(w.rank) + " is outside [0, " + std::to_string(w.world_size) +
        "); every process needs a distinct rank below the world size");
  }
  if (w.local_world_size < 1 || w.local_rank < 0 || w.local_rank >= w.local_world_size) {
    bad("local rank " + std::to_string(w.local_rank) + " is outside [0, " +
        std::to_string(w.local_world_size) + ")");
  }
  if (w.master_port < 0 || w.master_port > 65535) {
    bad("master port " + std::to_string(w.master_port) + " is not a TCP port (0-65535)");
  }
}

}  // namespace

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

World discover_world(const EnvLookup& env) {
  World w;
  if (env("RANK") && env("WORLD_SIZE")) {
    read_torchrun(env, w);
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    read_slurm(env, w);
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    read_mpi(env, w, "OMPI_COMM_WORLD_");
  } else if (env("PMI_RANK") && env("PMI_SIZE")) {
    read_mpi(env, w, "PMI_");
  }
  if (auto a = env("MASTER_ADDR"); a && !a->empty()) w.master_addr = *a;
  if (auto p = env_int(env, "MASTER_PORT")) w.master_port = static_cast<int>(*p);
  if (auto r = env("TORCHELASTIC_RUN_ID"); r && !r->empty()) w.run_id = *r;
  w.restart_count = need_int(env, "TORCHELASTIC_RESTART_COUNT", 0);
  w.max_restarts = need_int(env, "TORCHELASTIC_MAX_RESTARTS", 0);
  if (w.source == "openmpi" || w.source == "pmi") {
    if (w.num_nodes > 1 && !env("MASTER_ADDR")) {
      throw UsageError("an MPI job over " + std::to_string(w.num_nodes) +
                       " nodes needs MASTER_ADDR: export it to every rank, e.g. "
                       "`mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 ...`");
    }
  }
  check(w);
  return w;
}

std::string first_host_of_nodelist(const std::string& nodelist) {
  // The first entry ends at a comma that is not inside brackets.
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first += c;
  }
  auto open = first.find('[');
  if (open == std::string::npos) return first;
  std::string prefix = first.substr(0, open);
  std::string range = first.substr(open + 1);
  auto stop = range.find_first_of(",-]");
  return prefix + range.substr(0, stop);
}

std::string describe(const World& w) {
  std::ostringstream s;
  s << "rank " << w.rank << "/" << w.world_size << " (local " << w.local_rank << "/"
    << w.local_world_size << ", node " << w.node_rank << "/" << w.num_nodes << ") via " << w.source
    << ", master " << w.master_addr << ":" << w.master_port << ", run '" << w.run_id << "'";
  return s.str();
}

}  // namespace scaletrain
