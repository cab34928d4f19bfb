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

// n little-endian uint16 ids: byte values, but `bad` at position `at`.
std::string ids_with(int64_t n, int64_t at, int bad) {
  std::string bytes(static_cast<size_t>(2 * n), '\0');
  for (int64_t i = 0; i < n; ++i) {
    const int id = i == at ? bad : static_cast<int>(i * 7 % 251);
    bytes[static_cast<size_t>(2 * i)] = static_cast<char>(id & 0xff);
    bytes[static_cast<size_t>(2 * i + 1)] = static_cast<char>(id >> 8);
  }
  return bytes;
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

// An id at or past the vocabulary in the middle of a text file met the embedding at tp 1:
// "index out of range in self" and a 30-frame backtrace. The windows name the file, the id and
// its position, whatever reads them.
TEST(Hardening, TokenPastTheVocabularyInTheMiddleOfAFileGaveABacktrace) {
  TempDir dir("vocabulary");
  const std::string path = (dir.path / "val.bin").string();
  write_bytes(path, ids_with(2000, 1500, 300));
  TokenWindowOptions w;
  w.block_size = 64;
  w.mode = TokenWindowOptions::Mode::kStrided;
  w.vocab_size = 256;
  const DataSource windows = token_windows(path, w);
  EXPECT_NO_THROW(windows.batch({0, 1, 2}, 0)) << "the first windows hold byte ids only";
  try {
    windows.batch({3, 1500 / 64}, 0);  // the second window holds token 1500
    ADD_FAILURE() << "id 300 passed a vocabulary of 256";
  } catch (const UsageError& e) {
    EXPECT_TRUE(holds(e.what(), "token file '" + path + "' holds id 300 at token 1500"))
        << e.what();
    EXPECT_TRUE(holds(e.what(), "vocabulary of 256 ids: give a vocabulary of at least 301"))
        << e.what();
  }
  w.vocab_size = 301;
  std::vector<int64_t> all(static_cast<size_t>(token_windows(path, w).size));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  EXPECT_NO_THROW(token_windows(path, w).batch(all, 0));

  // The trainer at tp 1: evaluation reads val.bin's windows past the first ones.
  write_bytes(dir.path / "data" / "train.bin", ids_with(4000, -1, 0));
  write_bytes(dir.path / "data" / "val.bin", ids_with(2000, 1500, 300));
  auto r = run_command(cli_path() + " train --device cpu --model gpt-tiny --dataset text " +
                           "--data-dir " + (dir.path / "data").string() + " --out " +
                           (dir.path / "run").string() +
                           " --nproc-per-node 1 --epochs 1 --limit-train 32 --batch-size 16 "
                           "--no-progress --no-tensorboard",
                       180);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(holds(r.output, "data/val.bin' holds id 300 at token 1500")) << r.output;
  EXPECT_TRUE(holds(r.output, "give a vocabulary of at least 301 (--vocab-size)")) << r.output;
  EXPECT_FALSE(holds(r.output, "index out of range")) << r.output;
  EXPECT_FALSE(holds(r.output, "frame #")) << r.output;
}

}  // namespace
}  // namespace scaletrain
