// DataParallel transparency: at each of a few SGD steps with replicas on cpu,cpu,..., the loss
// and the primary's gradients are the single model's on the whole batch at the same weights
// (Note [Tolerances]: each against the exact float64 value, with the bound of its arithmetic).

#include "scaletrain/data_parallel.h"

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "scaletrain/error.h"
#include "support/tolerance.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

torch::nn::Sequential seq_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(6, 12), torch::nn::ReLU(),
                               torch::nn::Linear(12, 3));
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::mse_loss(out, y);
}

at::Tensor run_sequential(torch::nn::Module& m, const at::Tensor& x) {
  return static_cast<torch::nn::SequentialImpl&>(m).forward(x);
}

class DataParallelDevices : public ::testing::TestWithParam<int> {};

TEST_P(DataParallelDevices, ThreeStepsEqualTheSingleModel) {
  const int n = GetParam();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = at::randn({3, 11, 6}, gen), y = at::randn({3, 11, 3}, gen);  // 11: uneven split
  // Terms: forward fan-ins 7 and 13, the loss 3, backward fan-out 3, the batch of 11, and the
  // replicas' weighted losses and summed gradients (2 per replica).
  const double terms = 7 + 13 + 3 + 3 + 11 + 2 * n;

  DataParallel dp(seq_model(), std::vector<at::Device>(static_cast<size_t>(n), at::kCPU));
  torch::optim::SGD opt(dp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto make = [] { return seq_model().ptr(); };
  for (int step = 0; step < 3; ++step) {
    const std::string where = "step " + std::to_string(step);
    auto exact =
        testing::exact_and_magnitudes(make, run_sequential, testing::weights_of(*dp.replicas()[0]),
                                      x[step], testing::mse_gradient(y[step]));
    opt.zero_grad();
    auto loss = dp.train_step(x[step], y[step], mse);
    auto value = testing::mse_value(exact, y[step]);
    EXPECT_TRUE(testing::within_rounding(loss, value.exact, value.magnitude, terms)) << where;
    std::vector<at::Tensor> grads;
    for (auto& p : dp.parameters()) grads.push_back(p.grad());
    testing::expect_gradients_within_rounding(grads, exact, terms, where);
    opt.step();
  }
  auto exact =
      testing::exact_and_magnitudes(make, run_sequential, testing::weights_of(*dp.replicas()[0]),
                                    x[0], testing::mse_gradient(y[0]));
  torch::NoGradGuard g;
  EXPECT_TRUE(
      testing::within_rounding(dp.forward(x[0]), exact.output, exact.output_magnitude, terms));
}

INSTANTIATE_TEST_SUITE_P(Devices, DataParallelDevices, ::testing::Values(1, 2, 3));

// A zoo model's block chain cannot be cloned: replicas come from a factory and take the
// primary's weights. At each of two SGD steps on cpu,cpu the gradients are LeNet's own.
TEST(DataParallel, FactoryReplicasOfAZooModelEqualTheModel) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto x = at::randn({2, 7, 1, 28, 28}, gen);
  auto y = at::randint(10, {2, 7}, gen, at::kLong);
  auto ce = [](const at::Tensor& out, const at::Tensor& t) {
    return torch::nn::functional::cross_entropy(out, t);
  };
  // Terms: LeNet's forward fan-ins (1448, see models_test), the loss (18), the backward's
  // fan-outs (1569), conv1's weight gradient over 7 images of 26x26 outputs, the replicas (4).
  const double terms = 1448 + 18 + 1569 + 7 * 26 * 26 + 4;
  int built = 0;
  torch::manual_seed(4);
  DataParallel dp(
      [&] {
        ++built;
        return as_sequential(scaletrain::make_model("lenet"));
      },
      {at::kCPU, at::kCPU});
  EXPECT_EQ(built, 2);
  torch::optim::SGD opt(dp.parameters(), 0.1);
  for (int step = 0; step < 2; ++step) {
    auto exact = testing::exact_and_magnitudes(
        [] { return as_sequential(scaletrain::make_model("lenet")).ptr(); }, run_sequential,
        testing::weights_of(*dp.replicas()[0]), x[step], testing::cross_entropy_gradient(y[step]));
    opt.zero_grad();
    dp.train_step(x[step], y[step], ce);
    std::vector<at::Tensor> grads;
    for (auto& p : dp.parameters()) grads.push_back(p.grad());
    testing::expect_gradients_within_rounding(grads, exact, terms, "step " + std::to_string(step));
    opt.step();
  }
}

// A user's module of any type: a Cloneable one is cloned, another is built by a factory and
// given the primary's weights; either way the gradients are the module's own on the whole batch.
struct PlainNetImpl : torch::nn::Module {  // not Cloneable
  PlainNetImpl() {
    a = register_module("a", torch::nn::Linear(6, 12));
    b = register_module("b", torch::nn::Linear(12, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
struct CloneableNetImpl : torch::nn::Cloneable<CloneableNetImpl> {
  CloneableNetImpl() { reset(); }
  void reset() override {
    a = register_module("a", torch::nn::Linear(6, 12));
    b = register_module("b", torch::nn::Linear(12, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

template <typename Net>
void expect_user_module_transparent(const std::function<DataParallel(std::shared_ptr<Net>)>& wrap) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  auto x = at::randn({7, 6}, gen), y = at::randn({7, 3}, gen);
  torch::manual_seed(2);
  auto net = std::make_shared<Net>();
  auto exact = testing::exact_and_magnitudes(
      [] { return std::make_shared<Net>(); },
      [](torch::nn::Module& m, const at::Tensor& in) { return static_cast<Net&>(m).forward(in); },
      testing::weights_of(*net), x, testing::mse_gradient(y));
  DataParallel dp = wrap(net);
  ASSERT_EQ(dp.replicas().size(), 2u);
  EXPECT_EQ(dp.replicas()[0].get(), net.get()) << "the module itself is the primary";
  dp.train_step(x, y, mse);
  std::vector<at::Tensor> grads;
  for (auto& p : net->parameters()) grads.push_back(p.grad());
  testing::expect_gradients_within_rounding(grads, exact, 7 + 13 + 3 + 3 + 7 + 4, "user module");
}

TEST(DataParallel, AnyUserModuleClonedOrBuiltByAFactory) {
  expect_user_module_transparent<CloneableNetImpl>([](std::shared_ptr<CloneableNetImpl> n) {
    return DataParallel(n, {at::kCPU, at::kCPU});
  });
  expect_user_module_transparent<PlainNetImpl>([](std::shared_ptr<PlainNetImpl> n) {
    return DataParallel(n, std::function<std::shared_ptr<PlainNetImpl>()>([] {
                          return std::make_shared<PlainNetImpl>();
                        }),
                        {at::kCPU, at::kCPU});
  });
  // Without a factory, a module that cannot be cloned says what to do.
  try {
    DataParallel dp(std::make_shared<PlainNetImpl>(), {at::kCPU, at::kCPU});
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("give a factory"), std::string::npos) << e.what();
  }
  // One device needs no copy.
  EXPECT_NO_THROW(DataParallel(std::make_shared<PlainNetImpl>(), {at::kCPU}));
}

TEST(DataParallel, ReplicasPersistAcrossSteps) {
  DataParallel dp(seq_model(), {at::kCPU, at::kCPU});
  auto before = dp.replicas()[1].get();
  dp.train_step(at::randn({4, 6}), at::randn({4, 3}), mse);
  dp.train_step(at::randn({4, 6}), at::randn({4, 3}), mse);
  EXPECT_EQ(dp.replicas()[1].get(), before) << "replicas are kept, not re-cloned";
}

TEST(DataParallel, ReplicaErrorReachesTheCaller) {
  DataParallel dp(seq_model(), {at::kCPU, at::kCPU});
  try {
    dp.train_step(at::randn({4, 5}), at::randn({4, 3}), mse);  // 5 features, model wants 6
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("DataParallel replica"), std::string::npos) << e.what();
  }
  EXPECT_THROW(DataParallel(seq_model(), {}), UsageError);
}

}  // namespace
}  // namespace scaletrain
