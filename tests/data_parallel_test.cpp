// DataParallel transparency: gradients and a few SGD steps with replicas on cpu,cpu,... equal
// the single model on the whole batch (fp32, 1e-5).

#include "scaletrain/data_parallel.h"

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "scaletrain/error.h"
#include "scaletrain/models.h"

namespace scaletrain {
namespace {

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(6, 12), torch::nn::ReLU(),
                               torch::nn::Linear(12, 3));
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::mse_loss(out, y);
}

class DataParallelDevices : public ::testing::TestWithParam<int> {};

TEST_P(DataParallelDevices, ThreeStepsEqualTheSingleModel) {
  const int n = GetParam();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = at::randn({3, 11, 6}, gen), y = at::randn({3, 11, 3}, gen);  // 11: uneven split

  auto single = make_model();
  torch::optim::SGD opt1(single->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  DataParallel dp(make_model(), std::vector<at::Device>(static_cast<size_t>(n), at::kCPU));
  torch::optim::SGD opt2(dp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    opt1.zero_grad();
    auto l1 = mse(single->forward(x[step]), y[step]);
    l1.backward();
    opt2.zero_grad();
    auto l2 = dp.train_step(x[step], y[step], mse);
    EXPECT_NEAR(l1.item<double>(), l2.item<double>(), 1e-6);
    auto a = single->parameters(), b = dp.parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_LE((a[i].grad() - b[i].grad()).abs().max().item<double>(), 1e-5) << step << " " << i;
    }
    opt1.step();
    opt2.step();
  }
  torch::NoGradGuard g;
  EXPECT_LE((single->forward(x[0]) - dp.forward(x[0])).abs().max().item<double>(), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Devices, DataParallelDevices, ::testing::Values(1, 2, 3));

// A zoo model's block chain cannot be cloned: replicas come from a factory and take the
// primary's weights. Two SGD steps on cpu,cpu equal LeNet itself.
TEST(DataParallel, FactoryReplicasOfAZooModelEqualTheModel) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto x = at::randn({2, 7, 1, 28, 28}, gen);
  auto y = at::randint(10, {2, 7}, gen, at::kLong);
  auto ce = [](const at::Tensor& out, const at::Tensor& t) {
    return torch::nn::functional::cross_entropy(out, t);
  };
  torch::manual_seed(4);
  Model single = scaletrain::make_model("lenet");
  torch::optim::SGD opt1(single.module->parameters(), 0.1);
  int built = 0;
  torch::manual_seed(4);  // the first replica is built with the same seed: the same weights
  DataParallel dp(
      [&] {
        ++built;
        return as_sequential(scaletrain::make_model("lenet"));
      },
      {at::kCPU, at::kCPU});
  EXPECT_EQ(built, 2);
  torch::optim::SGD opt2(dp.parameters(), 0.1);
  for (int step = 0; step < 2; ++step) {
    opt1.zero_grad();
    ce(single.forward(x[step]), y[step]).backward();
    opt1.step();
    opt2.zero_grad();
    dp.train_step(x[step], y[step], ce);
    opt2.step();
  }
  auto a = single.module->parameters(), b = dp.parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LE((a[i] - b[i]).abs().max().item<double>(), 1e-5);
}

TEST(DataParallel, ReplicasPersistAcrossSteps) {
  DataParallel dp(make_model(), {at::kCPU, at::kCPU});
  auto before = dp.replicas()[1].get();
  dp.train_step(at::randn({4, 6}), at::randn({4, 3}), mse);
  dp.train_step(at::randn({4, 6}), at::randn({4, 3}), mse);
  EXPECT_EQ(dp.replicas()[1].get(), before) << "replicas are kept, not re-cloned";
}

TEST(DataParallel, ReplicaErrorReachesTheCaller) {
  DataParallel dp(make_model(), {at::kCPU, at::kCPU});
  try {
    dp.train_step(at::randn({4, 5}), at::randn({4, 3}), mse);  // 5 features, model wants 6
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("DataParallel replica"), std::string::npos) << e.what();
  }
  EXPECT_THROW(DataParallel(make_model(), {}), UsageError);
}

}  // namespace
}  // namespace scaletrain
