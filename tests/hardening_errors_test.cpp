// Faults of an outside review: bad input found only after the workers started, aborts and
// backtraces instead of messages, and run folders left with stale files. Each test is named
// after the fault it pins, and fails without its fix.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/loader.h"
#include "scaletrain/tokens.h"
#include "scaletrain/trainer.h"
#include "support/net.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using testing::cli_path;
using testing::run_command;
using testing::TempDir;

bool holds(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// What a command that bad input must stop before any worker starts printed: its message, and
// nothing of a launcher or a rank.
void expect_refused_before_start(const testing::CommandResult& r, const std::string& message) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(holds(r.output, message)) << r.output;
  EXPECT_FALSE(holds(r.output, "[rank")) << "a worker was started\n" << r.output;
  EXPECT_FALSE(holds(r.output, "terminate called")) << r.output;
}

std::string small_train(const std::string& out) {
  return cli_path() +
         " train --dataset synthetic --model mlp --epochs 1 --limit-train 64 --limit-test 32 "
         "--nproc-per-node 2 --no-progress --out " +
         out;
}

TEST(Hardening, WorkersOfAHundredThousandAbortedBothRanks) {
  TempDir dir("workers_100000");
  auto r = run_command(small_train((dir.path / "run").string()) + " --workers 100000");
  expect_refused_before_start(r,
                              "--workers 100000 must be from 0 (load on the training thread) "
                              "to 256 loader threads per rank");
  // The library's loader refuses the count itself, for a program of one's own.
  LoaderOptions lo;
  lo.workers = 100000;
  auto data = std::make_shared<const Dataset>(make_synthetic(8, 1, 4, 4, 2, 0));
  try {
    Loader loader(batches_of(data), {0, 1, 2}, lo);
    ADD_FAILURE() << "100000 loader workers were accepted";
  } catch (const UsageError& e) {
    EXPECT_TRUE(holds(e.what(), "loader workers 100000 must be from 0 to 256")) << e.what();
  }
}

TEST(Hardening, BackendDeviceAndDataDirWereFoundInTheWorkers) {
  TempDir dir("found_in_workers");
  const std::string train = small_train((dir.path / "run").string());
  expect_refused_before_start(run_command(train + " --backend mpi"), "unknown backend 'mpi'");
  expect_refused_before_start(run_command(train + " --device cuda:99"),
                              "--device cuda:99: this machine has ");
  const std::string missing = (dir.path / "nowhere").string();
  expect_refused_before_start(
      run_command(cli_path() + " train --nproc-per-node 2 --epochs 1 --out " +
                  (dir.path / "run").string() + " --data-dir " + missing),
      "--dataset fashion-mnist needs '" + missing + "/train-images-idx3-ubyte.gz'");
}

}  // namespace
}  // namespace scaletrain
