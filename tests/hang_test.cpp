// Hangs become failures with a name: a rank stopped by SIGSTOP in the middle of training is
// named by its pid by the launcher as it happens, and by its peers when their collective times
// out (the shared-memory gradient sum of ddp; Gloo's point-to-point of a pipeline grid, through
// the heartbeats, Note [Heartbeats]); the job ends within the timeout and leaves no process.

#include <gtest/gtest.h>

#include <regex>

#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

using testing::cli_path;
using testing::run_command;
using testing::script_path;
using testing::TempDir;

struct Hang {
  std::string name, flags;
  int rank;               // the one stopped
  std::string peer_says;  // a regular expression; {pid} stands for the stopped one's
};
void PrintTo(const Hang& h, std::ostream* os) { *os << h.name; }

class StoppedRank : public ::testing::TestWithParam<Hang> {};

TEST_P(StoppedRank, IsNamedByTheLauncherAndItsPeersWithinTheTimeout) {
  TempDir dir("stopped_rank_" + GetParam().name);
  const std::string out = (dir.path / "run").string();
  const std::string rank = std::to_string(GetParam().rank);
  auto r = run_command(
      "(" + script_path("stop_rank.sh") + " " + out + " " + rank + " &); " + cli_path() +
          " run --nproc-per-node 2 --master-port 0 --grace-period 3 -- " + cli_path() +
          " train --device cpu --dataset synthetic --limit-train 20000 "
          "--limit-test 64 --epochs 50 --batch-size 16 --log-every 1 "
          "--no-progress --timeout 5 " +
          GetParam().flags + " --out " + out,
      180);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("stopped ([0-9]+)"))) << r.output;
  const std::string pid = m[1];
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 90) << r.output;
  // The launcher, as it happens.
  EXPECT_NE(r.output.find("rank " + rank + " (pid " + pid + ") is stopped by a signal"),
            std::string::npos)
      << r.output;
  // Its peer, when the collective times out.
  const std::string says = std::regex_replace(GetParam().peer_says, std::regex("\\{pid\\}"), pid);
  EXPECT_TRUE(std::regex_search(r.output, std::regex(says))) << says << "\n" << r.output;
  // Nothing left behind: the stopped process was continued into its SIGTERM, or killed.
  EXPECT_NE(run_command("kill -0 " + pid + " 2>/dev/null").exit_code, 0) << "pid " << pid;
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, StoppedRank,
    ::testing::Values(
        // Regression (StoppedRankCaughtInTheStepLossSum): since the step lines give the global
        // batch's loss, a step has a small all-reduce over the backend besides DDP's gradients
        // through shared memory; a rank stopped there is named by its heartbeat.
        Hang{"ddp_shared_memory", "--strategy ddp", 1,
             "rank\\(s\\) 1 never joined it; rank 1 \\(pid {pid}\\) is stopped|"
             "not answering: rank 1 \\(host [^,]+, pid {pid}\\): no beat for"},
        Hang{"grid_gloo", "--strategy grid --pipeline-stages 2 --chunks 2", 1,
             "not answering: rank 1 \\(host [^,]+, pid {pid}\\): no beat for"},
        // Rank 0 serves the store and the heartbeats: stopped, it cannot answer for itself.
        Hang{"grid_gloo_rank0", "--strategy grid --pipeline-stages 2 --chunks 2", 0,
             "not answering: rank 0, whose heartbeat endpoint .* did not answer within 2 s"}),
    [](const ::testing::TestParamInfo<Hang>& p) { return p.param.name; });

}  // namespace
}  // namespace scaletrain
