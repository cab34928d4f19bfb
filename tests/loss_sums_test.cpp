// The training loss the trainer reports (Note [Global losses] in src/train/loss_sums.cpp): a
// step's loss is the global batch's and an epoch's the targets-weighted mean of its steps, the
// same numbers at every layout, across a resume at another layout too. The runs are the zoo's
// GPT in float64 on ranks as threads; two layouts do the same arithmetic grouped differently,
// so by Note [Tensor-parallel tolerance] in tensor_parallel_test.cpp their losses agree to
// within 1e-9 of their size. The faults these tests pin down were off by 1e-4 to 1e-1 of it.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "scaletrain/data.h"
#include "scaletrain/trainer.h"
#include "support/ranks.h"
#include "support/temp_dir.h"
#include "train/loss_sums.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

TEST(LossSums, WeightCountsTheTargetsTheLossAveragesOver) {
  auto tokens = at::tensor({3, -100, 5, 7, -100, 1}, at::kLong).view({2, 3});
  EXPECT_EQ(loss_weight(tokens).item<int64_t>(), 4);  // the ignored ones left out
  EXPECT_EQ(loss_weight(at::tensor({1, 0, 2}, at::kLong)).item<int64_t>(), 3);
  EXPECT_EQ(loss_weight(at::rand({5, 10})).item<int64_t>(), 5);  // probabilities: per sample
  LossSum s;
  s.add(2.0, 3);
  s.add(4.0, 1);
  s.add(std::nan(""), 0);  // every target ignored: nothing
  EXPECT_DOUBLE_EQ(s.mean(), 2.5);
  EXPECT_TRUE(std::isnan(LossSum{}.mean()));
}

TEST(LossSums, ResumeAtAnotherWorldGivesTheTotalToRankZero) {
  const auto rows = at::tensor({10.0, 4.0, 0.0, 0.0, 6.0, 2.0}).view({3, 2});
  EXPECT_DOUBLE_EQ(restored_loss_sums(rows, 2, 3).sum, 6.0);  // the same world: its own row
  const LossSum zero = restored_loss_sums(rows, 0, 2), one = restored_loss_sums(rows, 1, 2);
  EXPECT_DOUBLE_EQ(zero.sum, 16.0);
  EXPECT_DOUBLE_EQ(zero.weight, 6.0);
  EXPECT_DOUBLE_EQ(one.weight, 0.0);
  // An older file's unweighted rows: their mean, for 3 steps of 128 targets.
  const LossSum old = restored_unweighted_loss_sums(rows, 0, 3, 128);
  EXPECT_DOUBLE_EQ(old.mean(), 16.0 / 6.0);
  EXPECT_DOUBLE_EQ(old.weight, 384.0);
  EXPECT_DOUBLE_EQ(restored_unweighted_loss_sums(rows, 1, 3, 128).weight, 0.0);
}

ModelOptions gpt_options() {
  ModelOptions o;
  o.vocab_size = 16;
  o.context = 8;
  return o;
}

// 64 windows of 8 tokens and one set of starting weights; SGD without momentum, whose state is
// empty, so that a resume at another mesh (where the optimizer starts afresh) goes on as the
// uninterrupted run does.
struct Tokens {
  Dataset data;
  std::map<std::string, at::Tensor> start;
  Tokens() {
    auto g = at::make_generator<at::CPUGeneratorImpl>(11);
    auto t = at::randint(0, 16, {64, 9}, g, at::kLong);
    data = Dataset{t.narrow(1, 0, 8).contiguous(), t.narrow(1, 1, 8).contiguous(), 16};
    Model m = make_model("gpt-tiny", gpt_options());
    m.module->to(at::kDouble);
    for (const auto& p : m.module->named_parameters()) start[p.key()] = p.value().detach().clone();
  }
  TrainTask task() const {
    TrainTask t;
    t.train_data = in_memory(data);
    t.test_data = in_memory(data, 16);
    t.model = [w = &start] {
      Model m = make_model("gpt-tiny", gpt_options());
      m.module->to(at::kDouble);
      torch::NoGradGuard no_grad;
      for (auto& p : m.module->named_parameters()) p.value().copy_(w->at(p.key()));
      return m;
    };
    t.optimizer = [](const std::vector<at::Tensor>& p) {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.5));
    };
    return t;
  }
};

TrainerOptions options(const TempDir& dir, int tp) {
  TrainerOptions o;
  o.epochs = 1;
  o.batch_size = 16;  // 4 steps
  o.log_every = 1;
  o.progress = false;
  o.tensorboard = false;
  o.out_dir = dir.path.string();
  o.resume = Resume::none();
  o.device = at::kCPU;
  o.tensor_parallel.size = tp;
  return o;
}

void train_on(int world, const TrainTask& task, const TrainerOptions& o) {
  auto errors = testing::run_ranks(world, [&](Dist& d) { train(task, o, d); });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(world)));
}

// metrics.jsonl's losses: "step <n>" and "epoch <n>" to the loss.
std::map<std::string, double> losses(const TempDir& dir) {
  std::ifstream in(dir.path / "metrics.jsonl");
  std::map<std::string, double> out;
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    const std::string kind = j.at("kind");
    out[kind + " " + std::to_string(j.at(kind == "step" ? "step" : "epoch").get<int64_t>())] =
        j.at("loss").get<double>();
  }
  return out;
}

void expect_same_losses(const TempDir& got, const TempDir& want, const std::string& what) {
  const auto g = losses(got), w = losses(want);
  ASSERT_EQ(g.size(), w.size()) << what;
  ASSERT_EQ(w.size(), 5u) << what;  // 4 steps and the epoch
  for (const auto& [line, loss] : w) {
    ASSERT_TRUE(g.count(line)) << what << ": " << line;
    EXPECT_NEAR(g.at(line), loss, 1e-9 * std::abs(loss)) << what << ": " << line;
  }
}

// Regression (StepLossWasRankZerosShareUnderDdp): under ddp a step line gave rank 0's loss of
// its half of the batch, under dp (and a pipeline, a grid) with gradient accumulation the loss
// divided by the batches accumulated. Every layout now logs the global batch's loss.
TEST(GlobalLosses, StepLossWasRankZerosShareUnderDdp) {
  const Tokens tokens;
  TempDir one("loss_ddp1"), two("loss_ddp2"), dp("loss_dp");
  auto o = options(one, 1);
  o.accumulate = 2;
  train_on(1, tokens.task(), o);
  o.out_dir = two.path.string();
  train_on(2, tokens.task(), o);
  expect_same_losses(two, one, "ddp on 2 ranks against 1");
  o.out_dir = dp.path.string();
  o.strategy = Strategy::kDataParallel;
  o.devices = {at::kCPU, at::kCPU};
  train_on(1, tokens.task(), o);
  expect_same_losses(dp, one, "dp on cpu,cpu against ddp on 1 rank");
}

// Regression (EpochLossAfterResumeOnAnotherLayoutWasUnweighted): a tp 2 run stopped after its
// first step and resumed at dp 2 x tp 2 reported the plain mean of the two parts' means as the
// epoch's loss; each step's global loss now counts once, weighted by its tokens, whatever the
// layout before and after the resume.
TEST(GlobalLosses, EpochLossAfterResumeOnAnotherLayoutWasUnweighted) {
  const Tokens tokens;
  TempDir straight("loss_tp2"), moved("loss_tp2_dp2");
  train_on(2, tokens.task(), options(straight, 2));
  auto o = options(moved, 2);
  o.checkpoint_every = 1;
  auto stopped = testing::run_ranks(2, [&](Dist& d) {
    TrainTask t = tokens.task();
    t.on_step = [](const StepReport& r) {
      if (r.global_step == 1) throw std::runtime_error("stopped");
    };
    train(t, o, d);
  });
  ASSERT_EQ(stopped, (std::vector<std::string>{"stopped", "stopped"}));
  o.resume = Resume::automatic();
  train_on(4, tokens.task(), o);  // the mesh {dp: 2, tp: 2}
  expect_same_losses(moved, straight, "tp 2 resumed at dp 2 x tp 2 against tp 2");
}

}  // namespace
}  // namespace scaletrain
