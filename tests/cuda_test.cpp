// Tests that need a GPU: named *_CUDA, labelled "cuda" in CTest, skipped (never failed) where
// none is visible. They compile and link everywhere, so CUDA paths cannot rot unseen.

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>

#include "scaletrain/ddp.h"
#include "scaletrain/version.h"
#include "support/ranks.h"

namespace scaletrain {
namespace {

#define REQUIRE_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU visible"

TEST(Cuda, NcclAllReduceWorldOne_CUDA) {
  REQUIRE_GPU();
  InitOptions o;
  World w;
  w.master_port = testing::free_port();
  o.world = w;
  o.backend = "nccl";
  Dist d = init_process_group(o);
  EXPECT_EQ(d.backend_name, "nccl");
  std::vector<at::Tensor> t{at::arange(8, at::TensorOptions().device(at::kCUDA))};
  wait_for(d.backend->allreduce(t), "all-reduce", d);
  EXPECT_TRUE(at::equal(t[0].cpu(), at::arange(8)));
}

// Two ranks sharing one GPU over Gloo: DDP gradients of CUDA parameters equal the gradient of
// the whole batch in one process.
TEST(Cuda, DdpTwoRanksShareOneGpuOverGloo_CUDA) {
  REQUIRE_GPU();
  torch::manual_seed(0);
  torch::nn::Linear reference(6, 3);
  reference->to(at::kCUDA);
  auto x = at::randn({4, 6}, at::TensorOptions().device(at::kCUDA));
  reference(x).sum().backward();
  std::vector<at::Tensor> grads(2);
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    torch::manual_seed(0);
    auto model = std::make_shared<torch::nn::LinearImpl>(6, 3);
    model->to(at::kCUDA);
    DistributedDataParallel ddp(model, d);
    auto mine = x.narrow(0, 2 * d.rank(), 2);
    ddp.forward([&] { return model->forward(mine); }).sum().mul(2).backward();
    grads[static_cast<size_t>(d.rank())] = model->weight.grad().cpu();
  });
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  EXPECT_TRUE(at::allclose(grads[0], reference->weight.grad().cpu(), 1e-5, 1e-5));
  EXPECT_TRUE(at::equal(grads[0], grads[1]));
}

}  // namespace
}  // namespace scaletrain
