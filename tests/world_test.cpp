#include "scaletrain/world.h"

#include <gtest/gtest.h>

#include <map>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(World, NothingSetIsOneProcess) {
  World w = discover_world(env_of({}));
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.world_size, 1);
  EXPECT_EQ(w.source, "single");
  EXPECT_EQ(w.master_addr, "127.0.0.1");
}

TEST(World, TorchrunVariables) {
  World w = discover_world(env_of({{"RANK", "5"},
                                   {"WORLD_SIZE", "8"},
                                   {"LOCAL_RANK", "1"},
                                   {"LOCAL_WORLD_SIZE", "4"},
                                   {"GROUP_RANK", "1"},
                                   {"MASTER_ADDR", "10.1.2.3"},
                                   {"MASTER_PORT", "1234"},
                                   {"TORCHELASTIC_RUN_ID", "job7"},
                                   {"TORCHELASTIC_RESTART_COUNT", "2"},
                                   {"TORCHELASTIC_MAX_RESTARTS", "3"}}));
  EXPECT_EQ(w.source, "torchrun");
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.node_rank, 1);
  EXPECT_EQ(w.num_nodes, 2);
  EXPECT_EQ(w.master_addr, "10.1.2.3");
  EXPECT_EQ(w.master_port, 1234);
  EXPECT_EQ(w.run_id, "job7");
  EXPECT_EQ(w.restart_count, 2);
  EXPECT_EQ(w.max_restarts, 3);
}

TEST(World, SlurmVariables) {
  World w = discover_world(env_of({{"SLURM_PROCID", "3"},
                                   {"SLURM_NTASKS", "4"},
                                   {"SLURM_LOCALID", "1"},
                                   {"SLURM_NODEID", "1"},
                                   {"SLURM_NNODES", "2"},
                                   {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
                                   {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                                   {"SLURM_JOB_ID", "123456"}}));
  EXPECT_EQ(w.source, "slurm");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.world_size, 4);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 2);
  EXPECT_EQ(w.node_rank, 1);
  EXPECT_EQ(w.num_nodes, 2);
  EXPECT_EQ(w.master_addr, "gpu07");
  EXPECT_EQ(w.master_port, 29500 + 456);
  EXPECT_EQ(w.run_id, "slurm-123456");
}

TEST(World, TorchrunWinsOverSlurmWhenBothAreSet) {
  // torchrun started inside an srun allocation: torchrun's own variables describe the worker.
  World w = discover_world(
      env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}));
  EXPECT_EQ(w.source, "torchrun");
  EXPECT_EQ(w.rank, 1);
}

TEST(World, OpenMpiVariables) {
  World w = discover_world(env_of({{"OMPI_COMM_WORLD_RANK", "2"},
                                   {"OMPI_COMM_WORLD_SIZE", "3"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}}));
  EXPECT_EQ(w.source, "openmpi");
  EXPECT_EQ(w.rank, 2);
  EXPECT_EQ(w.world_size, 3);
  EXPECT_EQ(w.local_rank, 2);
  EXPECT_EQ(w.num_nodes, 1);
}

TEST(World, MpichPmiVariables) {
  World w = discover_world(env_of(
      {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}}));
  EXPECT_EQ(w.source, "pmi");
  EXPECT_EQ(w.rank, 1);
  EXPECT_EQ(w.world_size, 2);
}

TEST(World, MultiNodeMpiWithoutMasterAddrNamesTheFix) {
  try {
    discover_world(env_of({{"OMPI_COMM_WORLD_RANK", "0"},
                           {"OMPI_COMM_WORLD_SIZE", "4"},
                           {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("mpirun -x MASTER_ADDR"), std::string::npos) << e.what();
  }
}

TEST(World, RankNotBelowWorldSizeIsRejected) {
  try {
    discover_world(env_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}));
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 4 is outside [0, 4)"), std::string::npos)
        << e.what();
  }
}

TEST(World, NonIntegerVariableIsNamed) {
  try {
    discover_world(env_of({{"RANK", "one"}, {"WORLD_SIZE", "2"}}));
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='one'"), std::string::npos) << e.what();
  }
}

TEST(World, FirstHostOfNodelist) {
  EXPECT_EQ(first_host_of_nodelist("node1"), "node1");
  EXPECT_EQ(first_host_of_nodelist("node1,node2"), "node1");
  EXPECT_EQ(first_host_of_nodelist("gpu[03-05,9],cpu1"), "gpu03");
  EXPECT_EQ(first_host_of_nodelist("gpu[9,3-5]"), "gpu9");
  EXPECT_EQ(first_host_of_nodelist("rack1-n[001-004]"), "rack1-n001");
}

}  // namespace
}  // namespace scaletrain
