// Process-group bootstrap: rendezvous, run-id check, missing ranks, Gloo collectives.

#include <gtest/gtest.h>

#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "scaletrain/version.h"
#include "support/subprocess.h"

namespace scaletrain {
namespace {

using testing::cli_path;
using testing::run_command;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(Dist, AutoBackendIsNcclOnlyWithAGpuPerLocalProcess) {
  EXPECT_EQ(resolve_backend("auto", 0, 1), "gloo");
  EXPECT_EQ(resolve_backend("auto", 1, 1), "nccl");
  EXPECT_EQ(resolve_backend("auto", 1, 2), "gloo");  // two ranks would share the GPU
  EXPECT_EQ(resolve_backend("auto", 8, 8), "nccl");
  EXPECT_EQ(resolve_backend("auto", 8, 4), "nccl");
  EXPECT_EQ(resolve_backend("gloo", 8, 8), "gloo");
  EXPECT_EQ(resolve_backend("nccl", 1, 2), "nccl");  // asked for: NCCL's own error follows
}

TEST(Dist, SingleProcessGroupAllReduces) {
  InitOptions o;
  World w;
  w.master_port = testing::free_port();
  o.world = w;
  o.backend = "gloo";  // CPU tensors, on a machine with GPUs too
  Dist d = init_process_group(o);
  EXPECT_EQ(d.backend_name, "gloo");
  std::vector<at::Tensor> t{at::arange(4, at::kFloat)};
  d.backend->allreduce(t)->wait();
  EXPECT_TRUE(at::equal(t[0], at::arange(4, at::kFloat)));
}

class DistWorlds : public ::testing::TestWithParam<int> {};

TEST_P(DistWorlds, AllReduceAcrossProcessesStartedByTheLauncher) {
  const int n = GetParam();
  auto r = run_command(cli_path() + " run --nproc-per-node " + std::to_string(n) +
                       " --master-port 0 -- " + cli_path() + " check --numel 1000");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string want = std::to_string(n * (n + 1) / 2);
  for (int rank = 0; rank < n; ++rank) {
    EXPECT_TRUE(contains(r.output, "[rank" + std::to_string(rank) + "]:rank " +
                                       std::to_string(rank) +
                                       ": gloo all-reduce of 1000 floats "
                                       "ok (expected " +
                                       want))
        << r.output;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, DistWorlds, ::testing::Values(2, 3));

TEST(Dist, ProcessOfAnotherRunIsRefused) {
  const std::string port = std::to_string(testing::free_port());
  const std::string base =
      "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " WORLD_SIZE=2 SCALETRAIN_RDZV_TIMEOUT=5 ";
  auto r = run_command("(" + base + "RANK=0 TORCHELASTIC_RUN_ID=alpha " + cli_path() +
                       " check > /dev/null 2>&1 &) ; sleep 0.5; " + base +
                       "RANK=1 TORCHELASTIC_RUN_ID=beta " + cli_path() + " check");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 of run 'beta' reached the store at 127.0.0.1:" + port +
                                     ", which serves run 'alpha'"))
      << r.output;
}

TEST(Dist, MissingRanksAreNamedAfterTheTimeout) {
  const std::string port = std::to_string(testing::free_port());
  auto r = run_command("MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
                       " WORLD_SIZE=3 RANK=0 SCALETRAIN_RDZV_TIMEOUT=1.5 " + cli_path() + " check");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(r.seconds, 20);
  EXPECT_TRUE(contains(r.output, "2 of 3 ranks never arrived (ranks 1, 2)")) << r.output;
}

TEST(Dist, UnknownBackendIsAUsageError) {
  InitOptions o;
  o.world = World{};
  o.backend = "mpi-over-carrier-pigeon";
  EXPECT_THROW(init_process_group(o), UsageError);
}

TEST(Dist, NcclWithoutGpuIsRefusedClearly) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  InitOptions o;
  World w;
  w.master_port = testing::free_port();
  o.world = w;
  o.backend = "nccl";
  try {
    init_process_group(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "nccl")) << e.what();
  }
}

}  // namespace
}  // namespace scaletrain

namespace scaletrain {
namespace {

TEST(Dist, SingleNodeStoreListensOnLoopbackOnly) {
  if (run_command("command -v ss").exit_code != 0) GTEST_SKIP() << "no `ss` (iproute2) here";
  // Rank 0 of a 2-rank world waits at rendezvous; meanwhile look at its listening socket.
  const std::string port = std::to_string(testing::free_port());
  auto r = run_command("MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
                       " RANK=0 WORLD_SIZE=2 SCALETRAIN_RDZV_TIMEOUT=8 " + cli_path() +
                       " check > /dev/null 2>&1 & for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.5; "
                       "ss -Hltn 'sport = :" +
                       port +
                       "' | grep -q . && break; done; "
                       "ss -Hltn 'sport = :" +
                       port + "'; kill $! 2>/dev/null; wait");
  EXPECT_TRUE(contains(r.output, "127.0.0.1:" + port)) << r.output;
  EXPECT_FALSE(contains(r.output, "0.0.0.0:" + port)) << r.output;
  EXPECT_FALSE(contains(r.output, "*:" + port)) << r.output;
}

}  // namespace
}  // namespace scaletrain
