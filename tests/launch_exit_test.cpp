// Tests of the launcher's exit barrier (Note [Exit barrier] in src/launch/group_exit.cpp),
// through the real binary with shell workers, as launch_test.cpp drives it.

#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "support/subprocess.h"

namespace scaletrain {
namespace {

using testing::cli_path;
using testing::run_command;

bool says(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Three workers: rank 0 exits 0 at once, the others run for `others` (a shell command).
std::string three_workers(const std::string& flags, const std::string& others) {
  return cli_path() + " run --nproc-per-node 3 --master-port 0 --grace-period 1 " + flags +
         " -- sh -c 'if [ $RANK = 0 ]; then exit 0; fi; echo rank $RANK waits >&2; " + others + "'";
}

// Regression: a rank that exited 0 while another hung held the launcher for ever (as torchrun
// does). Once the first worker exits 0 the others get --exit-barrier-timeout seconds; those
// still running are stopped and named, with how long they ran after the first exit.
TEST(LaunchExit, RankExitingZeroWhileAnotherHangsHeldTheLauncherForever) {
  auto r = run_command(three_workers("--exit-barrier-timeout 1", "exec sleep 60"), 60);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(r.seconds, 20) << r.output;
  EXPECT_TRUE(says(r.output,
                   "worker group failed (attempt 1 of 1): rank 0 exited 0, and 2 other "
                   "worker(s) were still running --exit-barrier-timeout 1 s later"))
      << r.output;
  for (const char* rank : {"1", "2"}) {
    const std::regex line(std::string("  rank ") + rank +
                          R"( \(local rank [12], node 0, pid [0-9]+\) ran [1-9][0-9.]* s after )"
                          R"(rank 0's exit, then was stopped: it was killed by SIGTERM: rank )" +
                          rank + " waits");
    EXPECT_TRUE(std::regex_search(r.output, line)) << "rank " << rank << "\n" << r.output;
  }
}

// The barrier is a bound, not a delay: workers that finish within it end the job with 0.
TEST(LaunchExit, WorkersFinishingWithinTheBarrierSucceed) {
  auto r = run_command(three_workers("--exit-barrier-timeout 30", "sleep 1; exit 0"), 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 20) << r.output;
  EXPECT_FALSE(says(r.output, "failed")) << r.output;
}

// 0 waits for ever (torchrun's behaviour): a worker that takes longer than any small bound is
// not stopped.
TEST(LaunchExit, ZeroExitBarrierTimeoutWaitsForEver) {
  auto r = run_command(three_workers("--exit-barrier-timeout 0", "sleep 2; exit 0"), 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_GE(r.seconds, 2) << r.output;
}

TEST(LaunchExit, NegativeExitBarrierTimeoutIsRefusedBeforeAnyWorkerStarts) {
  for (const char* value : {"-1", "nan"}) {
    auto r = run_command(three_workers(std::string("--exit-barrier-timeout ") + value, "exit 0"));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(says(r.output, std::string("--exit-barrier-timeout ") + value +
                                   " must be 0 (wait for ever) or more seconds"))
        << r.output;
    EXPECT_FALSE(says(r.output, "[rank")) << r.output;
  }
}

}  // namespace
}  // namespace scaletrain
