// Mixed precision: autocast scopes and loss scaling, on the CPU (ATen's AMP kernels run there
// too); the CUDA path is the same code with another device type.

#include "scaletrain/amp.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <limits>
#include <string>
#include <vector>

#include "scaletrain/error.h"
#include "support/ranks.h"

namespace scaletrain {
namespace {

TEST(Autocast, CastsMatmulsInsideTheScopeOnly) {
  auto a = at::randn({4, 4}), b = at::randn({4, 4});
  {
    Autocast outer(at::kCPU, at::kBFloat16);
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
    {
      Autocast inner(at::kCPU, at::kBFloat16);
      EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
    }
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16) << "the inner scope ended the outer";
  }
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
  EXPECT_THROW(Autocast(at::kCPU, at::kDouble), UsageError);
}

struct Pair {
  torch::nn::Linear model{8, 2};
  torch::nn::Linear reference{8, 2};
  Pair() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i)
      reference->parameters()[i].copy_(model->parameters()[i]);
  }
};

// With a power-of-two scale, scaling and unscaling are exact: the step equals an unscaled one.
TEST(GradScaler, ScaledStepEqualsThePlainStep) {
  torch::manual_seed(0);
  Pair s;
  torch::optim::SGD opt(s.model->parameters(), 0.1), ref_opt(s.reference->parameters(), 0.1);
  GradScaler scaler;
  auto x = at::randn({16, 8});
  auto loss = s.model(x).pow(2).mean();
  scaler.scale(loss).backward();
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  s.reference(x).pow(2).mean().backward();
  ref_opt.step();
  for (size_t i = 0; i < s.model->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(s.model->parameters()[i], s.reference->parameters()[i]));
    EXPECT_TRUE(at::equal(s.model->parameters()[i].grad(), s.reference->parameters()[i].grad()));
  }
  EXPECT_EQ(scaler.current_scale(), 65536.0);
}

TEST(GradScaler, OverflowSkipsTheStepAndBacksOff) {
  torch::manual_seed(0);
  Pair s;
  torch::optim::SGD opt(s.model->parameters(), 0.1);
  GradScaler scaler;
  const auto before = s.model->weight.clone();
  scaler.scale(s.model(at::randn({4, 8})).sum()).backward();
  s.model->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_TRUE(at::equal(before, s.model->weight)) << "stepped on an inf gradient";
  EXPECT_EQ(scaler.current_scale(), 32768.0);
}

// Ranks holding different gradients (tensor parallelism's slices): an overflow on rank 0 only
// skips the step on both ranks with agree_over, and only on rank 0 without it.
TEST(GradScaler, AgreeOverSkipsEveryRanksStepWhenOneOverflows) {
  for (bool agree : {true, false}) {
    std::vector<int> stepped(2, -1);
    auto errors = testing::run_ranks(2, [&](Dist& d) {
      torch::nn::Linear m(2, 1);
      torch::optim::SGD opt(m->parameters(), 0.1);
      GradScalerOptions o;
      if (agree) o.agree_over = &d;
      GradScaler scaler(o);
      scaler.scale(m(at::ones({1, 2})).sum()).backward();
      if (d.rank() == 0) m->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
      stepped[static_cast<size_t>(d.rank())] = scaler.step(opt) ? 1 : 0;
      scaler.update();
    });
    ASSERT_EQ(errors, std::vector<std::string>(2));
    EXPECT_EQ(stepped[0], 0) << "agree " << agree;
    EXPECT_EQ(stepped[1], agree ? 0 : 1) << "agree " << agree;
  }
}

TEST(GradScaler, GrowsAfterGrowthIntervalGoodSteps) {
  torch::manual_seed(0);
  Pair s;
  torch::optim::SGD opt(s.model->parameters(), 0.01);
  GradScalerOptions o;
  o.init_scale = 4;
  o.growth_interval = 3;
  GradScaler scaler(o);
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    scaler.scale(s.model(at::randn({4, 8})).sum()).backward();
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();
    EXPECT_EQ(scaler.current_scale(), i < 2 ? 4.0 : 8.0) << "after step " << i;
  }
}

TEST(GradScaler, DisabledPassesThrough) {
  Pair s;
  torch::optim::SGD opt(s.model->parameters(), 0.1);
  GradScalerOptions o;
  o.enabled = false;
  GradScaler scaler(o);
  auto loss = s.model(at::ones({1, 8})).sum();
  EXPECT_TRUE(at::equal(scaler.scale(loss), loss));
  EXPECT_EQ(scaler.current_scale(), 1.0);
  EXPECT_THROW(GradScaler(GradScalerOptions{0.0}), UsageError);
}

}  // namespace
}  // namespace scaletrain
