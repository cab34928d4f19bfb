// Tests that need a GPU: named *_CUDA, labelled "cuda" in CTest, skipped (never failed) where
// none is visible. They compile and link everywhere, so CUDA paths cannot rot unseen.

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>

#include <torch/optim/sgd.h>

#include <filesystem>

#include "scaletrain/checkpoint.h"
#include "scaletrain/data_parallel.h"
#include "scaletrain/ddp.h"
#include "scaletrain/models.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/trainer.h"
#include "scaletrain/version.h"
#include "support/ranks.h"
#include "support/subprocess.h"

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

// Two processes sharing one GPU over Gloo (NCCL refuses two ranks on one GPU, and rank threads
// of one process cannot share CUDA's single autograd thread): one epoch of DDP training ends
// with the weights of one process training on the same global batches.
TEST(Cuda, DdpTwoProcessesShareOneGpuOverGloo_CUDA) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "scaletrain_cuda_ddp_gloo";
  fs::remove_all(dir);
  auto train_with = [&](int procs) {
    const fs::path out = dir / std::to_string(procs);
    auto r = testing::run_command(
        testing::cli_path() + " train --nproc-per-node " + std::to_string(procs) +
            " --device cuda --backend gloo --model mlp --dataset synthetic --limit-train 512"
            " --limit-test 64 --epochs 1 --batch-size 64 --no-progress --resume none --out " +
            out.string() + " 2>&1",
        180);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    Model m = make_model("mlp");
    load_weights((out / "model.pt").string(), *m.module);
    return m.module->parameters();
  };
  auto one = train_with(1), two = train_with(2);
  ASSERT_EQ(one.size(), two.size());
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_LE((one[i] - two[i]).abs().max().item<double>(), 1e-5) << i;
  }
  fs::remove_all(dir);
}

torch::nn::Sequential small_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Linear(16, 16),
                               torch::nn::Linear(16, 4));
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::mse_loss(out, y);
}

// Two stages on one GPU, each on a stream of its own: the gradients of the whole CPU model.
TEST(Cuda, PipelineTwoStagesOnOneGpuWithStreams_CUDA) {
  REQUIRE_GPU();
  auto x = at::randn({10, 8}), y = at::randn({10, 4});
  auto whole = small_model();
  mse(whole->forward(x), y).backward();
  for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    PipelineOptions o;
    o.balance = {1, 2};
    o.devices = {at::Device(at::kCUDA, 0), at::Device(at::kCUDA, 0)};
    o.chunks = 3;
    o.schedule = sched;
    o.checkpoint = PipelineCheckpoint::kExceptLast;
    Pipeline pipe(small_model(), o);
    pipe.train_step(x, y, mse);
    std::vector<at::Tensor> got;
    for (auto& st : pipe.stages()) {
      for (auto& p : st->parameters()) got.push_back(p.grad().cpu());
    }
    auto want = whole->parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LE((got[i] - want[i].grad()).abs().max().item<double>(), 1e-5) << i;
    }
  }
}

TEST(Cuda, DataParallelTwoReplicasOnOneGpu_CUDA) {
  REQUIRE_GPU();
  auto x = at::randn({9, 8}), y = at::randn({9, 4});
  auto whole = small_model();
  mse(whole->forward(x), y).backward();
  const at::Device gpu(at::kCUDA, 0);
  DataParallel dp(small_model(), {gpu, gpu});
  dp.train_step(x.to(gpu), y.to(gpu), mse);
  auto got = dp.parameters();
  auto want = whole->parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_LE((got[i].grad().cpu() - want[i].grad()).abs().max().item<double>(), 1e-5) << i;
  }
}

// The trainer on the GPU with fp16 autocast and loss scaling, DDP over NCCL with world size 1:
// it runs, on cuda:0, and reports CUDA's peak allocated memory.
TEST(Cuda, TrainerFp16OnGpu_CUDA) {
  REQUIRE_GPU();
  TrainOptions o;
  o.dataset = "synthetic";
  o.limit_train = 512;
  o.limit_test = 128;
  o.epochs = 1;
  o.batch_size = 64;
  o.progress = false;
  o.device = "cuda";
  o.amp = "fp16";
  o.out_dir = ::testing::TempDir() + "/scaletrain_cuda_trainer";
  o.resume = "none";
  TrainResult r;
  auto errors = testing::run_ranks(
      1, [&](Dist& d) { r = train(o, d); }, std::chrono::seconds(60), "nccl");
  ASSERT_EQ(errors, std::vector<std::string>{""});
  EXPECT_EQ(r.device, "cuda:0");
  EXPECT_GT(r.peak_memory_bytes, 0);
  EXPECT_EQ(r.global_step, 8);
}

// Weights and a full checkpoint written from cuda:0 load into a model on the CPU, bit for bit.
TEST(Cuda, WeightsAndCheckpointFromGpuLoadOnCpu_CUDA) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "scaletrain_cuda_weights";
  fs::remove_all(dir);
  fs::create_directories(dir);
  torch::manual_seed(1);
  Model gpu = make_model("lenet");
  gpu.module->to(at::kCUDA);
  torch::optim::SGD gpu_opt(gpu.module->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto x = at::randn({8, 1, 28, 28}, at::TensorOptions().device(at::kCUDA));
  gpu.forward(x).sum().backward();
  gpu_opt.step();
  save_weights((dir / "w.pt").string(), *gpu.module);
  save_weights((dir / "w.safetensors").string(), *gpu.module);
  TrainingState state;
  state.model_name = "lenet";
  state.epoch = 1;
  state.global_step = 1;
  const std::string ckpt = save_checkpoint(dir.string(), state, *gpu.module, gpu_opt, 1);
  std::vector<at::Tensor> want;
  for (auto& p : gpu.module->parameters()) want.push_back(p.detach().cpu());
  for (const std::string file : {"w.pt", "w.safetensors"}) {
    Model cpu = make_model("lenet");
    load_weights((dir / file).string(), *cpu.module);
    auto got = cpu.module->parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(got[i].device().is_cpu());
      EXPECT_TRUE(at::equal(got[i], want[i])) << file << " parameter " << i;
    }
  }
  Model cpu = make_model("lenet");
  torch::optim::SGD cpu_opt(cpu.module->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto loaded = load_checkpoint(ckpt, *cpu.module, cpu_opt, "lenet");
  EXPECT_EQ(loaded.global_step, 1);
  auto got = cpu.module->parameters();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << i;
  fs::remove_all(dir);
}

// Seed 000's model parallel on one GPU: the small-image ResNet-18 as blocks, split over two
// stages on cuda:0 (one chunk, two streams), gives the single-device model's output and
// gradients. cuDNN's TF32 is off so that fp32 means fp32 on both sides.
TEST(Cuda, ResNetModelParallelOnOneGpuEqualsOneDevice_CUDA) {
  REQUIRE_GPU();
  at::globalContext().setAllowTF32CuDNN(false);
  at::globalContext().setAllowTF32CuBLAS(false);
  torch::manual_seed(2);
  Model whole = make_model("resnet18");
  whole.module->to(at::kCUDA);
  whole.module->eval();  // BatchNorm with running statistics: identical on both sides
  torch::manual_seed(2);
  Model split = make_model("resnet18");
  split.module->eval();
  auto x = at::randn({6, 1, 28, 28}, at::TensorOptions().device(at::kCUDA));
  auto y = at::randn({6, 10}, at::TensorOptions().device(at::kCUDA));
  mse(whole.forward(x), y).backward();
  auto seq = as_sequential(split);
  PipelineOptions o;
  const int n = static_cast<int>(seq->size());
  o.balance = {n / 2, n - n / 2};
  o.devices = {at::Device(at::kCUDA, 0), at::Device(at::kCUDA, 0)};
  Pipeline mp(seq, o);
  auto loss = mp.train_step(x, y, mse);
  EXPECT_NEAR(loss.item<double>(), mse(whole.forward(x), y).item<double>(), 1e-5);
  auto got = split.module->parameters();
  auto want = whole.module->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_LE((got[i].grad() - want[i].grad()).abs().max().item<double>(), 1e-4) << i;
  }
  at::globalContext().setAllowTF32CuDNN(true);
}

}  // namespace
}  // namespace scaletrain
