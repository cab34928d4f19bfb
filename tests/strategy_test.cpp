// The trainer's strategies (src/train/strategy.cpp, grid.cpp), driven through the library's
// train() with a model and data of the test's own (not the zoo):
//
// Transparency: every epoch is one step over the whole data set; after each, every rank's model
// must hold the exact SGD step from the weights it held before — w - lr·g(w), with g the exact
// (float64) gradient over all the samples, within the bound of the arithmetic (Note
// [Tolerances]) — for ddp, dp, pipeline (GPipe and 1F1B) and a grid of 2 replicas x 2 stages.
//
// Batch norm, which the transparency model leaves out on purpose, has each strategy's own
// semantics, stated and checked at the end.

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "scaletrain/blocks.h"
#include "scaletrain/data.h"
#include "scaletrain/data_parallel.h"
#include "scaletrain/ddp.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/trainer.h"
#include "support/net.h"
#include "support/ranks.h"
#include "support/tolerance.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

// A model of the test's own, in three blocks, 12 wide.
using testing::NetImpl;
constexpr int64_t kWidth = 12;
Model net_model(const std::shared_ptr<NetImpl>& net) { return testing::model_of_net(net); }

struct Case {
  std::string name;
  Strategy strategy;
  int world = 1;
  std::vector<std::string> devices;
  PipelineSchedule schedule = PipelineSchedule::kGPipe;
  int chunks = 0;
  double max_norm = 0;  // TrainerOptions::max_grad_norm
  PipelineCheckpoint checkpointing = PipelineCheckpoint::kNever;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class StrategyTransparency : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyTransparency, EachStepIsTheExactGradientStep) {
  const Case c = GetParam();
  constexpr int64_t kSamples = 24;
  constexpr int kSteps = 3;
  constexpr double kLr = 0.1;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
  Dataset data;
  data.inputs = at::randn({kSamples, 6}, gen);
  data.targets = at::randint(3, {kSamples}, gen, at::kLong);
  data.num_classes = 3;
  const fs::path out = fs::temp_directory_path() /
                       ("scaletrain_strategy_" + c.name + "_" + std::to_string(getpid()));
  fs::remove_all(out);

  std::mutex mu;  // ranks are threads: they share the generator and these maps
  std::map<std::thread::id, std::shared_ptr<NetImpl>> primary;
  std::map<int, std::vector<std::vector<at::Tensor>>> weights;  // rank -> after each step
  std::vector<at::Tensor> start;
  auto errors = testing::run_ranks(c.world, [&](Dist& d) {
    TrainTask task;
    task.train_data = in_memory(data);
    task.model = [&] {
      // train() seeds the global generator on each rank, and here the ranks are threads that
      // share it: draw the start from a generator of the model's own, or a rank seeding while
      // another draws changes that rank's start (a grid stage then starts elsewhere).
      std::lock_guard<std::mutex> lock(mu);
      auto net = std::make_shared<NetImpl>(kWidth);
      auto init = at::make_generator<at::CPUGeneratorImpl>(3);
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.copy_(at::randn(p.sizes(), init) * 0.3);
      if (!primary.count(std::this_thread::get_id())) {
        primary[std::this_thread::get_id()] = net;
        if (start.empty()) start = testing::weights_of(*net);
      }
      return net_model(net);
    };
    task.optimizer =
        [](const std::vector<at::Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(kLr));
    };
    task.on_epoch = [&](const EpochReport&) {
      std::lock_guard<std::mutex> lock(mu);
      weights[d.rank()].push_back(testing::weights_of(*primary.at(std::this_thread::get_id())));
    };
    TrainerOptions o;
    o.strategy = c.strategy;
    for (const auto& dev : c.devices) o.devices.push_back(parse_device(dev));
    if (c.strategy == Strategy::kPipeline || c.strategy == Strategy::kGrid) {
      o.pipeline.schedule = c.schedule;  // a pipeline's own options: refused elsewhere
      o.pipeline.chunks = c.chunks;
      o.pipeline.checkpoint = c.checkpointing;
    }
    o.max_grad_norm = c.max_norm;
    o.epochs = kSteps;
    o.batch_size = kSamples;  // one step per epoch, over every sample
    o.workers = 0;
    o.progress = o.tensorboard = o.channels_last = false;
    o.log_every = 0;
    o.device = at::kCPU;
    o.out_dir = out.string();
    train(task, o, d);
  });
  ASSERT_EQ(errors, std::vector<std::string>(static_cast<size_t>(c.world))) << c.name;

  // Terms: forward fan-ins 7, 13, 13; the loss 18; backward fan-outs 12, 12, 3; the batch;
  // the replicas' and micro-batches' sums and weights; the update's three roundings.
  // Clipping: the norm sums the squares of the 279 gradient entries (each within the bound
  // above) and scales every one by the coefficient: its relative error adds 279 + 4 terms.
  const double terms = 7 + 13 + 13 + 18 + 27 + kSamples + 2 * std::max(c.chunks, 4) + c.world + 3 +
                       (c.max_norm > 0 ? 279 + 4 : 0);
  auto forward = [](torch::nn::Module& m, const at::Tensor& x) {
    return static_cast<NetImpl&>(m).forward(x);
  };
  std::vector<at::Tensor> before = start;
  for (int step = 0; step < kSteps; ++step) {
    auto exact = testing::exact_and_magnitudes([] { return std::make_shared<NetImpl>(kWidth); },
                                               forward, before, data.inputs,
                                               testing::cross_entropy_gradient(data.targets));
    const auto& after = weights[0][static_cast<size_t>(step)];
    ASSERT_EQ(after.size(), before.size());
    double coef = 1;  // PyTorch's clip_grad_norm_ with the exact global norm
    if (c.max_norm > 0) {
      double squares = 0;
      for (const auto& g : exact.grads) squares += g.square().sum().item<double>();
      coef = std::min(1.0, c.max_norm / (std::sqrt(squares) + 1e-6));
      ASSERT_LT(coef, 0.9) << "the case must clip";
    }
    for (size_t i = 0; i < after.size(); ++i) {
      auto w = before[i].to(at::kDouble);
      EXPECT_TRUE(testing::within_rounding(
          after[i], w - kLr * coef * exact.grads[i],
          w.abs() + kLr * coef * (exact.grad_magnitudes[i] + exact.grads[i].abs()), terms))
          << c.name << ", step " << step << ", parameter " << i;
    }
    for (int r = 1; r < c.world; ++r) {  // every rank holds the same model
      for (size_t i = 0; i < after.size(); ++i) {
        EXPECT_TRUE(at::equal(weights[r][static_cast<size_t>(step)][i], after[i]))
            << c.name << ": rank " << r << ", step " << step << ", parameter " << i;
      }
    }
    before = after;
  }
  fs::remove_all(out);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, StrategyTransparency,
    ::testing::Values(
        Case{"ddp", Strategy::kDDP, 2, {}},
        Case{"dp", Strategy::kDataParallel, 1, {"cpu", "cpu", "cpu"}},
        Case{"pipeline_gpipe", Strategy::kPipeline, 1, {"cpu", "cpu"}, PipelineSchedule::kGPipe, 4},
        Case{"pipeline_1f1b",
             Strategy::kPipeline,
             1,
             {"cpu", "cpu", "cpu"},
             PipelineSchedule::k1F1B,
             3},
        Case{"pipeline_zb_h1",
             Strategy::kPipeline,
             1,
             {"cpu", "cpu"},
             PipelineSchedule::kZeroBubbleH1,
             4},
        Case{"grid", Strategy::kGrid, 4, {}, PipelineSchedule::k1F1B, 3},
        Case{"grid_zb_h1", Strategy::kGrid, 2, {}, PipelineSchedule::kZeroBubbleH1, 4},
        // Activation checkpointing: the forwards run again in backward, the steps are the same.
        Case{"pipeline_recomputed",
             Strategy::kPipeline,
             1,
             {"cpu", "cpu"},
             PipelineSchedule::k1F1B,
             4,
             0,
             PipelineCheckpoint::kAlways},
        Case{"grid_recomputed",
             Strategy::kGrid,
             4,
             {},
             PipelineSchedule::k1F1B,
             3,
             0,
             PipelineCheckpoint::kExceptLast},
        Case{"grid_zb_h1_recomputed",
             Strategy::kGrid,
             2,
             {},
             PipelineSchedule::kZeroBubbleH1,
             4,
             0,
             PipelineCheckpoint::kAlways},
        Case{"zero1", Strategy::kZero1, 2, {}}, Case{"zero2", Strategy::kZero2, 3, {}},
        Case{"fsdp", Strategy::kFsdp, 4, {}},
        // Clipping by the global norm, wherever each rank holds which part of the gradients.
        Case{"ddp_clipped", Strategy::kDDP, 2, {}, PipelineSchedule::kGPipe, 0, 0.05},
        Case{"dp_clipped",
             Strategy::kDataParallel,
             1,
             {"cpu", "cpu"},
             PipelineSchedule::kGPipe,
             0,
             0.05},
        Case{"pipeline_clipped",
             Strategy::kPipeline,
             1,
             {"cpu", "cpu"},
             PipelineSchedule::k1F1B,
             4,
             0.05},
        Case{"grid_clipped", Strategy::kGrid, 4, {}, PipelineSchedule::k1F1B, 3, 0.05},
        Case{"zero1_clipped", Strategy::kZero1, 2, {}, PipelineSchedule::kGPipe, 0, 0.05},
        Case{"zero2_clipped", Strategy::kZero2, 3, {}, PipelineSchedule::kGPipe, 0, 0.05},
        Case{"fsdp_clipped", Strategy::kFsdp, 4, {}, PipelineSchedule::kGPipe, 0, 0.05}),
    [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

// ---- Batch norm's semantics per strategy -----------------------------------------------------
// A model with batch norm computes another function under each strategy than on the whole batch
// in one piece, by design (as in PyTorch): the statistics are those of the part each replica or
// stage sees.

torch::nn::Sequential bn_model() {
  torch::manual_seed(8);
  return torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6),
                               torch::nn::Linear(6, 2));
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::mse_loss(out, y);
}

at::Tensor running_mean(torch::nn::Sequential m) {
  return m[1]->as<torch::nn::BatchNorm1d>()->running_mean.clone();
}

// dp: each replica normalises its slice with the slice's statistics; the running statistics
// are the primary's, from its slice (the first rows), as if the others were not there.
TEST(BatchNormSemantics, DataParallelKeepsThePrimarysSliceStatistics) {
  auto x = at::randn({8, 4}), y = at::randn({8, 2});
  DataParallel dp(bn_model(), {at::kCPU, at::kCPU});
  dp.train_step(x, y, mse);
  auto alone = bn_model();
  alone->forward(x.narrow(0, 0, 4));
  torch::nn::Sequential primary(
      std::dynamic_pointer_cast<torch::nn::SequentialImpl>(dp.replicas()[0]));
  EXPECT_TRUE(at::equal(running_mean(primary), running_mean(alone)));
}

// pipeline: a stage's batch norm sees each micro-batch alone, and its running statistics move
// once per micro-batch (m times per step), in the micro-batches' order.
TEST(BatchNormSemantics, PipelineUpdatesOncePerMicroBatch) {
  auto x = at::randn({8, 4}), y = at::randn({8, 2});
  PipelineOptions o;
  o.balance = {2, 1};
  o.devices = {at::kCPU, at::kCPU};
  o.chunks = 2;
  auto model = bn_model();
  Pipeline pipe(model, o);
  pipe.train_step(x, y, mse);
  auto alone = bn_model();
  alone->forward(x.narrow(0, 0, 4));
  alone->forward(x.narrow(0, 4, 4));
  EXPECT_TRUE(at::equal(running_mean(model), running_mean(alone)));
}

// ddp: each rank normalises its own batch; before every forward, rank 0's running statistics
// are broadcast (broadcast_buffers), so the ranks' buffers agree at each step's start.
TEST(BatchNormSemantics, DdpBroadcastsRankZerosStatisticsBeforeEachForward) {
  std::vector<at::Tensor> after_step(2), at_next_forward(2);
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    auto model = [] {
      static std::mutex mu;
      std::lock_guard<std::mutex> lock(mu);
      return bn_model();
    }();
    DistributedDataParallel ddp(model, d);
    auto x = at::randn({4, 4}, at::make_generator<at::CPUGeneratorImpl>(d.rank()));
    ddp(x).sum().backward();
    after_step[static_cast<size_t>(d.rank())] = running_mean(model);
    model->eval();  // no update: what the forward starts from is what stays
    torch::NoGradGuard no_grad;
    ddp(x);
    at_next_forward[static_cast<size_t>(d.rank())] = running_mean(model);
  });
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  EXPECT_FALSE(at::equal(after_step[0], after_step[1])) << "each rank's own batch";
  EXPECT_TRUE(at::equal(at_next_forward[1], after_step[0])) << "rank 0's, broadcast";
  EXPECT_TRUE(at::equal(at_next_forward[0], after_step[0]));
}

}  // namespace
}  // namespace scaletrain
