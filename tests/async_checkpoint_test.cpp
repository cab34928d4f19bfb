// Checkpoints written in the background (AsyncCheckpointer): the file equals the synchronous
// one, holds the state of the moment save() was called whatever the training does after, one
// write at a time, failures surface, and a crash during the write leaves the previous
// checkpoint valid.

#include <gtest/gtest.h>
#include <signal.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>

#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// A small model with parameters and buffers (BatchNorm's running statistics).
torch::nn::Sequential small_model() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::BatchNorm1d(5),
                               torch::nn::Linear(5, 3));
}

std::unique_ptr<torch::optim::Optimizer> optimizer_of(const std::string& kind,
                                                      torch::nn::Sequential& m) {
  auto p = m->parameters();
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(p);
  if (kind == "adamw") {
    // Two groups, the second with its own options: the groups and their order are saved.
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>(p.begin(), p.begin() + 2));
    groups.emplace_back(std::vector<at::Tensor>(p.begin() + 2, p.end()),
                        std::make_unique<torch::optim::AdamWOptions>(0.01));
    return std::make_unique<torch::optim::AdamW>(groups);
  }
  return std::make_unique<torch::optim::Adagrad>(p);  // a kind the snapshot cannot copy
}

void train_steps(torch::nn::Sequential& m, torch::optim::Optimizer& opt, int steps) {
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    m->forward(torch::randn({8, 6})).pow(2).mean().backward();
    opt.step();
  }
}

TrainingState state_at(int64_t step) {
  TrainingState s;
  s.run_id = "run-1";
  s.model_name = "small";
  s.epoch = 1;
  s.step_in_epoch = step;
  s.global_step = step;
  s.sampler.epoch = 1;
  s.sampler.position = 8 * step;
  s.tensors["mine"] = torch::arange(4.0) * static_cast<double>(step);
  s.values["note"] = "at " + std::to_string(step);
  return s;
}

// Everything a load gives back: the weights, the state, and the weights after one more step
// on a fixed batch, which depend on every part of the optimizer's state (its step count too).
struct Loaded {
  std::vector<at::Tensor> weights, stepped;
  TrainingState state;
};

Loaded load(const std::string& path, const std::string& kind) {
  auto m = small_model();
  auto opt = optimizer_of(kind, m);
  Loaded out;
  out.state = load_checkpoint(path, *m, *opt, "small");
  for (auto& t : m->parameters()) out.weights.push_back(t.detach().clone());
  for (auto& t : m->buffers()) out.weights.push_back(t.detach().clone());
  torch::manual_seed(11);
  train_steps(m, *opt, 1);
  for (auto& t : m->parameters()) out.stepped.push_back(t.detach().clone());
  return out;
}

void expect_same(const Loaded& a, const Loaded& b) {
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i) {
    EXPECT_TRUE(at::equal(a.weights[i], b.weights[i])) << "tensor " << i;
  }
  ASSERT_EQ(a.stepped.size(), b.stepped.size());
  for (size_t i = 0; i < a.stepped.size(); ++i) {
    EXPECT_TRUE(at::equal(a.stepped[i], b.stepped[i])) << "parameter " << i << " after a step";
  }
  EXPECT_EQ(a.state.global_step, b.state.global_step);
  EXPECT_EQ(a.state.sampler.position, b.state.sampler.position);
  EXPECT_EQ(a.state.values, b.state.values);
  ASSERT_EQ(a.state.tensors.size(), b.state.tensors.size());
  for (auto& [k, t] : a.state.tensors) EXPECT_TRUE(at::equal(t, b.state.tensors.at(k))) << k;
  EXPECT_TRUE(a.state.optimizer_restored && b.state.optimizer_restored);
}

class AsyncCheckpoint : public ::testing::TestWithParam<std::string> {};

// The background file loads to the same model, optimizer state and training state as the one
// save_checkpoint() writes at the same moment; for every optimizer kind, the one whose state is
// serialised within save() included.
TEST_P(AsyncCheckpoint, EqualsTheSynchronousFile) {
  TempDir sync_dir("async_sync_" + GetParam()), async_dir("async_async_" + GetParam());
  auto m = small_model();
  auto opt = optimizer_of(GetParam(), m);
  train_steps(m, *opt, 3);
  const auto a = save_checkpoint(sync_dir.path.string(), state_at(3), *m, *opt, 2);
  AsyncCheckpointer writer;
  const auto b = writer.save(async_dir.path.string(), state_at(3), *m, opt.get(), 2);
  writer.wait();
  EXPECT_EQ(writer.last_written(), b);
  EXPECT_EQ(fs::path(a).filename(), fs::path(b).filename());
  EXPECT_EQ(checkpoint_problem(b), std::nullopt);
  const auto x = load(a, GetParam()), y = load(b, GetParam());
  expect_same(x, y);
}

// The snapshot is the state at save(): the writer is held back until the model and optimizer
// have trained further (in place), and the file still holds the state of the save.
TEST_P(AsyncCheckpoint, HoldsTheStateOfTheMomentOfSave) {
  TempDir sync_dir("async_moment_sync_" + GetParam()), async_dir("async_moment_" + GetParam());
  auto m = small_model();
  auto opt = optimizer_of(GetParam(), m);
  train_steps(m, *opt, 2);
  std::promise<void> trained;
  auto go = trained.get_future().share();
  AsyncCheckpointOptions options;
  options.before_serialize = [go](const std::string&) { go.wait(); };
  AsyncCheckpointer writer(options);
  auto s = state_at(2);
  const auto b = writer.save(async_dir.path.string(), s, *m, opt.get(), 2);
  const auto a = save_checkpoint(sync_dir.path.string(), s, *m, *opt, 2);
  s.tensors["mine"].add_(100);  // the program's own tensors are copied too
  train_steps(m, *opt, 2);
  trained.set_value();
  writer.wait();
  s.tensors["mine"].sub_(100);
  expect_same(load(a, GetParam()), load(b, GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Optimizers, AsyncCheckpoint,
                         ::testing::Values("sgd", "adam", "adamw", "adagrad"));

// One write at a time: a save() while a write is in progress waits for it, and the writes
// finish in the order of the saves.
TEST(AsyncCheckpointer, NextSaveWaitsForThePreviousWrite) {
  TempDir dir("async_order");
  auto m = small_model();
  auto opt = optimizer_of("sgd", m);
  std::promise<void> release;
  auto go = release.get_future().share();
  std::mutex mu;
  std::vector<std::string> renamed;
  AsyncCheckpointer writer({nullptr, [&](const std::string& tmp) {
                              if (tmp.find("ckpt-1.st") != std::string::npos) go.wait();
                              std::lock_guard<std::mutex> lock(mu);
                              renamed.push_back(fs::path(tmp).filename().string().substr(0, 9));
                            }});
  writer.save(dir.path.string(), state_at(1), *m, opt.get(), 5);
  EXPECT_TRUE(writer.busy());
  std::atomic<bool> second_returned{false};
  std::thread second([&] {
    writer.save(dir.path.string(), state_at(2), *m, opt.get(), 5);
    second_returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(second_returned) << "save() returned while the previous write was held";
  release.set_value();
  second.join();
  writer.wait();
  EXPECT_FALSE(writer.busy());
  EXPECT_EQ(renamed, (std::vector<std::string>{"ckpt-1.st", "ckpt-2.st"}));
  EXPECT_GT(writer.timing().waited, 0.1);
  EXPECT_GT(writer.timing().write, 0);
  EXPECT_EQ(newest_valid_checkpoint(dir.path.string()), (dir.path / "ckpt-2.st").string());
}

// A write that fails in the background is thrown by the next wait(), once, naming the file.
TEST(AsyncCheckpointer, AFailedWriteIsThrownByTheNextWait) {
  TempDir dir("async_fail");
  std::ofstream(dir.path / "file") << "x";
  auto m = small_model();
  auto opt = optimizer_of("adam", m);
  AsyncCheckpointer writer;
  const auto path = writer.save((dir.path / "file" / "sub").string(), state_at(1), *m, opt.get(),
                                2);  // a folder under a file: cannot be made
  try {
    writer.wait();
    FAIL() << "the failed write was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(writer.wait());
  EXPECT_EQ(writer.last_written(), "");
  EXPECT_THROW(writer.save(
                   dir.path.string(),
                   [] {
                     auto s = state_at(1);
                     s.run_id = "a run";
                     return s;
                   }(),
                   *m, opt.get(), 2),
               UsageError);
}

// A crash during the background write (here: SIGKILL once the temporary is written, before its
// rename) leaves the previous checkpoint the newest valid one, loadable, and no file under the
// new one's name; the resume picks the previous one.
TEST(AsyncCheckpointer, KilledDuringTheWriteLeavesThePreviousCheckpoint) {
  // The child runs this test again from its start in a process of its own (a fork of a process
  // with an intra-op thread pool may hang); it finds the folder in the environment.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const char* kDir = "SCALETRAIN_TEST_ASYNC_KILLED_DIR";
  std::unique_ptr<TempDir> dir;
  if (std::getenv(kDir) == nullptr) {
    dir = std::make_unique<TempDir>("async_killed");
    ::setenv(kDir, dir->path.c_str(), 1);
  }
  const std::string d = std::getenv(kDir);
  // The same in both processes: small_model() seeds the generator.
  auto m = small_model();
  auto opt = optimizer_of("adam", m);
  train_steps(m, *opt, 1);
  EXPECT_EXIT(
      {
        AsyncCheckpointer writer({nullptr, [](const std::string& tmp) {
                                    if (tmp.find("ckpt-2.st") != std::string::npos)
                                      ::raise(SIGKILL);
                                  }});
        writer.save(d, state_at(1), *m, opt.get(), 1);
        writer.wait();
        train_steps(m, *opt, 1);
        writer.save(d, state_at(2), *m, opt.get(), 1);
        writer.wait();
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGKILL), "");
  ::unsetenv(kDir);
  EXPECT_FALSE(fs::exists(d + "/ckpt-2.st"));
  ASSERT_EQ(newest_valid_checkpoint(d), d + "/ckpt-1.st");
  // Regression (KilledWriteLeftItsTemporaryForever): the killed write's temporary stays while it
  // is fresh, and the next checkpoint removes it once it is a minute old (its writer is gone).
  std::vector<fs::path> left;
  for (auto& e : fs::directory_iterator(d)) {
    if (e.path().extension() == ".tmp") left.push_back(e.path());
  }
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].filename().string().rfind("ckpt-2.st.", 0), 0u) << left[0];
  save_checkpoint(d, state_at(3), *m, *opt, 5);
  EXPECT_TRUE(fs::exists(left[0])) << "removed while fresh";
  fs::last_write_time(left[0], fs::file_time_type::clock::now() - std::chrono::minutes(2));
  save_checkpoint(d, state_at(4), *m, *opt, 5);
  EXPECT_FALSE(fs::exists(left[0])) << "a dead writer's temporary stayed";
  // The file is the one of step 1: this process's model and optimizer are still at step 1.
  TempDir again("async_killed_again");
  const auto expected = save_checkpoint(again.path.string(), state_at(1), *m, *opt, 1);
  expect_same(load(expected, "adam"), load(d + "/ckpt-1.st", "adam"));
}

}  // namespace
}  // namespace scaletrain
