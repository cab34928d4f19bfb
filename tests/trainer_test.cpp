// The trainer end to end: checkpoints, exact resume after a SIGKILL (through the launcher's
// restart), and bad input refused before any training.

#include "scaletrain/trainer.h"

#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"
#include "scaletrain/models.h"
#include "support/ranks.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using testing::cli_path;
using testing::run_command;

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("scaletrain_" + name + "_" + std::to_string(getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::vector<at::Tensor> params_of(const std::string& checkpoint) {
  Model m = make_model("lenet");
  torch::optim::SGD opt(m.module->parameters(), 0.1);
  load_checkpoint(checkpoint, *m.module, opt, "lenet");
  std::vector<at::Tensor> out;
  for (auto& p : m.module->parameters()) out.push_back(p.detach().clone());
  return out;
}

std::string train_cmd(const fs::path& out) {
  return " train --dataset synthetic --limit-train 384 --limit-test 64 --epochs 2 "
         "--batch-size 64 --checkpoint-every 2 --no-progress --out " +
         out.string();
}

class ExactResume : public ::testing::TestWithParam<int> {};

TEST_P(ExactResume, KilledMidEpochTwoAndRestartedEqualsStraightRun) {
  const std::string n = std::to_string(GetParam());
  TempDir straight("straight" + n), killed("killed" + n);
  auto a = run_command(cli_path() + " run --nproc-per-node " + n + " --master-port 0 --" + " " +
                       cli_path() + train_cmd(straight.path));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  // 6 steps per epoch: step 9 is in the middle of epoch 2; the newest checkpoint is step 8.
  auto b =
      run_command("SCALETRAIN_KILL_AT_STEP=9 " + cli_path() + " run --nproc-per-node " + n +
                  " --master-port 0 --max-restarts 1 -- " + cli_path() + train_cmd(killed.path));
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("was killed by SIGKILL"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("resumed from"), std::string::npos) << b.output;
  auto x = params_of((straight.path / "ckpt-12.st").string());
  auto y = params_of((killed.path / "ckpt-12.st").string());
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(at::equal(x[i], y[i])) << "parameter " << i;
}

INSTANTIATE_TEST_SUITE_P(Processes, ExactResume, ::testing::Values(1, 2));

TEST(Checkpoint, TruncatedOrCorruptFilesAreSkipped) {
  TempDir dir("ckpt");
  Model m = make_model("lenet");
  torch::optim::SGD opt(m.module->parameters(), 0.1);
  TrainingState s;
  s.model_name = "lenet";
  for (int64_t step : {1, 2, 3}) {
    s.global_step = step;
    save_checkpoint(dir.path.string(), s, *m.module, opt, 2);
  }
  EXPECT_FALSE(fs::exists(dir.path / "ckpt-1.st")) << "keep 2";
  // Damage the newest: cut it short.
  auto newest = dir.path / "ckpt-3.st";
  fs::resize_file(newest, fs::file_size(newest) - 10);
  EXPECT_NE(checkpoint_problem(newest.string())->find("truncated"), std::string::npos);
  EXPECT_EQ(newest_valid_checkpoint(dir.path.string()), (dir.path / "ckpt-2.st").string());
  // Flip a byte of the other: checksum mismatch.
  {
    std::fstream f(dir.path / "ckpt-2.st", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x42');
  }
  EXPECT_NE(checkpoint_problem((dir.path / "ckpt-2.st").string())->find("checksum"),
            std::string::npos);
  EXPECT_FALSE(newest_valid_checkpoint(dir.path.string()).has_value());
}

TEST(Checkpoint, AnotherModelIsRefused) {
  TempDir dir("ckpt_model");
  Model toy = make_model("toy");
  torch::optim::SGD opt(toy.module->parameters(), 0.1);
  TrainingState s;
  s.model_name = "toy";
  auto path = save_checkpoint(dir.path.string(), s, *toy.module, opt, 1);
  Model lenet = make_model("lenet");
  torch::optim::SGD opt2(lenet.module->parameters(), 0.1);
  EXPECT_THROW(load_checkpoint(path, *lenet.module, opt2, "lenet"), UsageError);
}

struct Bad {
  std::string args, message;
};
class TrainBadInput : public ::testing::TestWithParam<Bad> {};

TEST_P(TrainBadInput, IsRefusedBeforeTraining) {
  auto r = run_command(cli_path() + " train --nproc-per-node 2 --no-progress " + GetParam().args);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(GetParam().message), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("epoch 1"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Cases, TrainBadInput,
                         ::testing::Values(Bad{"--model resnet9000", "unknown model 'resnet9000'"},
                                           Bad{"--dataset imagenet", "unknown data set 'imagenet'"},
                                           Bad{"--batch-size 1",
                                               "is smaller than the world size 2"},
                                           Bad{"--out /proc/scaletrain", "is not writable"}));

TEST(Train, LearnsOnRealFashionMnistSubset) {
  if (!fs::exists(std::string("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  TempDir dir("fmnist");
  TrainOptions o;
  o.limit_train = 6144;
  o.limit_test = 1000;
  o.epochs = 3;
  o.progress = false;
  o.out_dir = dir.path.string();
  o.resume = "none";
  TrainResult r;
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    auto mine = train(o, d);
    if (d.rank() == 0) r = mine;
  });
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  // Ranks as threads share the global generator, so initial weights (rank 0's, broadcast)
  // vary between runs: 72 steps reach 0.6-0.75; chance is 0.1.
  EXPECT_GT(r.test_accuracy, 0.5);
  EXPECT_EQ(r.global_step, 3 * 24);
  std::ifstream metrics(r.metrics_path);
  std::string line, last;
  while (std::getline(metrics, line)) last = line;
  EXPECT_NE(last.find("\"kind\":\"epoch\""), std::string::npos) << last;
  EXPECT_NE(last.find("\"test_accuracy\""), std::string::npos) << last;
}

}  // namespace
}  // namespace scaletrain
