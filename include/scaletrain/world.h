#pragma once
// Where this process stands in a multi-process job: its rank, the world size, its node, and the
// master that holds the rendezvous store. Read from the environment a launcher leaves behind,
// so the same binary runs unchanged under `scaletrain run`, torchrun, Slurm's srun and mpirun.
//
// Thread-safety: all functions here are pure or only read the environment.

#include <functional>
#include <optional>
#include <string>

namespace scaletrain {

struct World {
  int rank = 0;              // global rank, 0 <= rank < world_size
  int world_size = 1;        // number of processes in the job
  int local_rank = 0;        // rank within this node
  int local_world_size = 1;  // processes on this node
  int node_rank = 0;         // GROUP_RANK in torchrun's words
  int num_nodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string run_id = "none";    // rendezvous refuses processes of another run
  int restart_count = 0;          // TORCHELASTIC_RESTART_COUNT
  int max_restarts = 0;           // TORCHELASTIC_MAX_RESTARTS
  std::string source = "single";  // which dialect was read: torchrun, slurm, openmpi, pmi, single

  bool is_master() const { return rank == 0; }
};

/// Looks up an environment variable; nullopt when unset. Tests pass their own.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

/// The real process environment.
EnvLookup process_env();

/// Reads the world from the environment, in this order of precedence:
///  1. torchrun / `scaletrain run`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
///     MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, ...
///  2. Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES, the first
///     host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST as master, port from MASTER_PORT or
///     29500 + SLURM_JOB_ID % 1000.
///  3. Open MPI: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE; MPICH/Hydra: PMI_RANK,
///     PMI_SIZE, MPI_LOCALRANKID. Multi-node MPI jobs must export MASTER_ADDR (mpirun -x).
///  4. Nothing set: a single process (rank 0 of 1).
/// MASTER_ADDR / MASTER_PORT, when set, override what a dialect derives.
/// Throws UsageError naming the variable, its value and the fix when values are malformed or
/// inconsistent (e.g. RANK >= WORLD_SIZE).
World discover_world(const EnvLookup& env = process_env());

/// The first host name of a Slurm node list: "gpu[03-05,9],cpu1" -> "gpu03".
std::string first_host_of_nodelist(const std::string& nodelist);

/// One line describing the world, for logs: "rank 1/4 (local 1/2, node 0/2) via torchrun".
std::string describe(const World& world);

}  // namespace scaletrain
