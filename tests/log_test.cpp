// The library's words go to the sink the program sets (log.h), never to the terminal by
// themselves: the trainer's epoch lines and progress, a resume's notes and a finished run's
// notice reach a sink of the program's own, and with no sink nothing reaches standard output.

#include "scaletrain/log.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>
#include <vector>

#include "scaletrain/data.h"
#include "scaletrain/trainer.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

struct Captured {
  std::mutex mu;
  std::vector<std::pair<LogLevel, std::string>> lines;
  bool has(LogLevel level, const std::string& part) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [l, text] : lines) {
      if (l == level && text.find(part) != std::string::npos) return true;
    }
    return false;
  }
};

// Puts the console back whatever the test does.
struct SinkGuard {
  LogSink before;
  explicit SinkGuard(LogSink sink) : before(set_log_sink(std::move(sink))) {}
  ~SinkGuard() { set_log_sink(before); }
};

TrainResult train_once(const std::string& out, int epochs) {
  TrainTask task;
  task.model = [] { return make_model("mlp"); };
  task.train_data = in_memory(make_synthetic(64, 1, 28, 28, 10, 1));
  task.test_data = in_memory(make_synthetic(32, 1, 28, 28, 10, 2));
  TrainerOptions o;
  o.epochs = epochs;
  o.batch_size = 16;
  o.device = at::kCPU;
  o.tensorboard = false;
  o.progress = true;
  o.out_dir = out;
  TrainResult r;
  auto errors = testing::run_ranks(1, [&](Dist& d) { r = train(task, o, d); });
  EXPECT_EQ(errors, std::vector<std::string>(1));
  return r;
}

TEST(Log, TheTrainersLinesGoToTheSinkTheProgramSets) {
  testing::TempDir dir("log_sink");
  const std::string out = (dir.path / "run").string();
  Captured got;
  {
    SinkGuard sink([&got](LogLevel level, const std::string& line) {
      std::lock_guard<std::mutex> lock(got.mu);
      got.lines.emplace_back(level, line);
    });
    ::testing::internal::CaptureStdout();
    train_once(out, 1);
    train_once(out, 1);  // resumed from the finished run: nothing left to train
    EXPECT_EQ(::testing::internal::GetCapturedStdout(), "") << "the library printed by itself";
  }
  EXPECT_TRUE(got.has(LogLevel::kInfo, "epoch 1: loss ")) << "the epoch line";
  EXPECT_TRUE(got.has(LogLevel::kProgress, "epoch 1")) << "the progress";
  EXPECT_TRUE(got.has(LogLevel::kInfo, "resumed from ")) << "the resume";
  EXPECT_TRUE(got.has(LogLevel::kInfo, "all 1 epochs were already trained in " + out));
}

TEST(Log, NoSinkSilencesTheLibraryAndTheConsoleIsTheDefault) {
  testing::TempDir dir("log_silent");
  {
    SinkGuard silent(nullptr);
    ::testing::internal::CaptureStdout();
    train_once((dir.path / "silent").string(), 1);
    EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
  }
  ::testing::internal::CaptureStdout();
  train_once((dir.path / "console").string(), 1);
  const std::string console = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(console.find("epoch 1: loss "), std::string::npos) << console;
}

// The command line's sink shows the library's option names as its flags: a run started again in
// the folder of a finished one is told which flags go on or start over.
TEST(Log, TheCommandLineShowsTheLibrarysLinesWithItsFlags) {
  testing::TempDir dir("log_cli");
  const std::string cmd = testing::cli_path() +
                          " train --device cpu --dataset synthetic --model mlp --limit-train 64"
                          " --limit-test 32 --epochs 1 --batch-size 32 --no-progress --out " +
                          (dir.path / "run").string() + " 2>&1";
  auto first = testing::run_command(cmd, 120);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto again = testing::run_command(cmd, 120);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("give more --epochs to continue, or --resume none to start again"),
            std::string::npos)
      << again.output;
  EXPECT_EQ(again.output.find("TrainerOptions::"), std::string::npos) << again.output;
}

}  // namespace
}  // namespace scaletrain
