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

// ---- The run folder at the end: no stale temporaries, no replaced shards ---------------------

TrainerOptions zero1_options(const std::string& out, CheckpointFormat format) {
  TrainerOptions o;
  o.strategy = Strategy::kZero1;
  o.checkpoint_format = format;
  o.epochs = 1;
  o.batch_size = 12;
  o.checkpoint_every = 1;
  o.keep = 10;
  o.out_dir = out;
  o.progress = false;
  o.tensorboard = false;
  o.log_every = 0;
  o.workers = 0;
  o.channels_last = false;
  o.device = at::kCPU;
  return o;
}

TrainTask task_of_48(std::mutex& mu) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  Dataset data;
  data.inputs = at::randn({48, 6}, gen);
  data.targets = at::randint(3, {48}, gen, at::kLong);
  data.num_classes = 3;
  TrainTask task;
  task.train_data = in_memory(data);
  task.model = [&mu] { return testing::net_model(mu); };
  return task;
}

// zero1 over 2 rank threads, sharded checkpoints, stopped right after the checkpoint of step 2.
void sharded_run_stopped_at_step_2(const std::string& out, std::mutex& mu) {
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    TrainTask task = task_of_48(mu);
    task.on_step = [](const StepReport& r) {
      if (r.global_step == 2) throw std::runtime_error("stopped at step 2");
    };
    train(task, zero1_options(out, CheckpointFormat::kSharded), d);
  });
  for (const auto& e : errors) ASSERT_EQ(e, "stopped at step 2");
  ASSERT_TRUE(fs::exists(fs::path(out) / "world-2" / "rank-1" / "ckpt-2.st"));
}

pid_t a_dead_pid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  return child;
}

std::vector<std::string> temporaries_under(const fs::path& dir) {
  std::vector<std::string> out;
  for (auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.path().extension() == ".tmp") out.push_back(fs::relative(e.path(), dir).string());
  }
  return out;
}

// Background writes killed mid-write left their temporaries, seconds old, in folders no later
// checkpoint wrote (the shards of the world before a resume at another size): the finished
// run's folder kept them. A temporary of a live process (this one) is left alone.
TEST(Hardening, StaleTemporariesStayedInAFinishedFolder) {
  TempDir dir("stale_temporaries");
  const std::string out = (dir.path / "run").string();
  std::mutex mu;
  sharded_run_stopped_at_step_2(out, mu);
  const std::string dead = std::to_string(a_dead_pid()), live = std::to_string(getpid());
  for (const std::string& f : std::vector<std::string>{
           "world-2/rank-1/ckpt-3.st." + dead + "-0.tmp", "ckpt-3.st." + dead + "-1.tmp",
           "model.pt." + dead + "-2.tmp", "run.json.tmp"}) {
    write_bytes(fs::path(out) / f, "half a file");
  }
  write_bytes(fs::path(out) / "world-2" / "rank-0" / ("ckpt-3.st." + live + "-7.tmp"), "live");
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    train(task_of_48(mu), zero1_options(out, CheckpointFormat::kSharded), d);
  });
  ASSERT_EQ(errors[0], "");
  EXPECT_TRUE(fs::exists(fs::path(out) / "world-1" / "rank-0" / "ckpt-4.st"));
  EXPECT_EQ(temporaries_under(out),
            std::vector<std::string>{"world-2/rank-0/ckpt-3.st." + live + "-7.tmp"});
}

// A run that resumed from sharded checkpoints and went on in the full format left every shard
// behind. They go once a full checkpoint is on disk, never before (a full write that fails
// leaves them), and another run's shards stay.
TEST(Hardening, OldShardsStayedAfterASwitchBackToTheFullFormat) {
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    TempDir dir(async ? "format_switch_async" : "format_switch");
    const fs::path out = dir.path / "run";
    std::mutex mu;
    sharded_run_stopped_at_step_2(out.string(), mu);
    TrainingState other;
    other.run_id = "another-run";
    other.global_step = 1;
    torch::nn::Linear lonely(2, 2);
    save_checkpoint((out / "world-3" / "rank-0").string(), other, *lonely, nullptr, 1);
    TrainerOptions full = zero1_options(out.string(), CheckpointFormat::kFull);
    full.async_checkpoint = async;
    // A full checkpoint that cannot be written (a folder holds its name): the shards stay.
    fs::create_directories(out / "ckpt-3.st" / "in-the-way");
    auto failed = testing::run_ranks(2, [&](Dist& d) { train(task_of_48(mu), full, d); });
    EXPECT_TRUE(holds(failed[0], "ckpt-3.st")) << failed[0];
    EXPECT_TRUE(fs::exists(out / "world-2" / "rank-1" / "ckpt-2.st"));
    fs::remove_all(out / "ckpt-3.st");
    auto errors = testing::run_ranks(2, [&](Dist& d) { train(task_of_48(mu), full, d); });
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
    EXPECT_TRUE(fs::exists(out / "ckpt-4.st"));
    EXPECT_FALSE(fs::exists(out / "world-2")) << "the replaced shards and their folders";
    EXPECT_TRUE(fs::exists(out / "world-3" / "rank-0" / "ckpt-1.st")) << "another run's shard";
  }
}

}  // namespace
}  // namespace scaletrain
