// Tests that need a GPU: named *_CUDA, labelled "cuda" in CTest, skipped (never failed) where
// none is visible. They compile and link everywhere, so CUDA paths cannot rot unseen.

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>

#include <torch/optim/sgd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/data_parallel.h"
#include "scaletrain/ddp.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/trainer.h"
#include "scaletrain/version.h"
#include "scaletrain_zoo.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/tolerance.h"
#include "support/zoo.h"
#include "zoo_models.h"

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
// of one process cannot share CUDA's single autograd thread): one DDP step of the trainer, from
// weights the test wrote, on the 64 synthetic samples it makes, gives the exact SGD step, with 1
// process and with 2 (Note [Tolerances]).
TEST(Cuda, DdpTwoProcessesShareOneGpuOverGloo_CUDA) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "scaletrain_cuda_ddp_gloo";
  fs::remove_all(dir);
  fs::create_directories(dir);
  torch::manual_seed(5);
  Model start = make_model("mlp");
  save_weights((dir / "start.pt").string(), *start.module);
  // The trainer's defaults: SGD lr 0.05, momentum 0.9 (a first step's buffer is the gradient),
  // weight decay 5e-4; synthetic data of seed 0 + 1.
  const double lr = 0.05, wd = 5e-4;
  Dataset data = make_synthetic(64, 1, 28, 28, 10, 1);
  auto zoo = testing::zoo_reference("mlp");
  auto exact =
      testing::exact_and_magnitudes(zoo.make, zoo.forward, testing::weights_of(*start.module),
                                    data.inputs, testing::cross_entropy_gradient(data.targets));
  // Terms: forward 785 + 257, the loss 18, backward 10, the batch of 64, DDP's average over 2,
  // and the update's four roundings.
  const double terms = 785 + 257 + 18 + 10 + 64 + 3 + 4;
  auto train_with = [&](int procs) {
    const fs::path out = dir / std::to_string(procs);
    auto r = testing::run_command(
        testing::cli_path() + " train --nproc-per-node " + std::to_string(procs) +
            " --device cuda --backend gloo --model mlp --dataset synthetic --limit-train 64"
            " --limit-test 64 --epochs 1 --batch-size 64 --no-progress --resume none"
            " --init-weights " +
            (dir / "start.pt").string() + " --out " + out.string() + " 2>&1",
        180);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    Model m = make_model("mlp");
    load_weights((out / "model.pt").string(), *m.module);
    return m.module->parameters();
  };
  for (int procs : {1, 2}) {
    auto got = train_with(procs);
    auto w0 = testing::weights_of(*start.module);
    ASSERT_EQ(got.size(), w0.size());
    for (size_t i = 0; i < got.size(); ++i) {
      auto w = w0[i].to(at::kDouble);
      auto want = w - lr * (exact.grads[i] + wd * w);
      auto magnitude = w.abs() + lr * (exact.grad_magnitudes[i] + wd * w.abs());
      EXPECT_TRUE(testing::within_rounding(got[i], want, magnitude, terms))
          << procs << " process(es), parameter " << i;
    }
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

at::Tensor run_sequential(torch::nn::Module& m, const at::Tensor& x) {
  return static_cast<torch::nn::SequentialImpl&>(m).forward(x);
}

// The exact gradients of small_model() on (x, y), and the terms of its longest chain: forward
// fan-ins 9, 17, 17, the loss 3, backward fan-outs 16, 16, the batch, and `extra` (micro-batch
// or replica weights and sums).
testing::Exact small_model_exact(const at::Tensor& x, const at::Tensor& y) {
  return testing::exact_and_magnitudes([] { return small_model().ptr(); }, run_sequential,
                                       testing::weights_of(*small_model()), x,
                                       testing::mse_gradient(y));
}
double small_model_terms(int64_t rows, double extra) {
  return 9 + 17 + 17 + 3 + 16 + 16 + static_cast<double>(rows) + extra;
}

// fp32 on the GPU is fp32: no TF32 in cuBLAS or cuDNN while a test compares with fp32 bounds.
struct NoTF32 {
  bool cublas = at::globalContext().allowTF32CuBLAS();
  bool cudnn = at::globalContext().allowTF32CuDNN();
  NoTF32() {
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }
  ~NoTF32() {
    at::globalContext().setAllowTF32CuBLAS(cublas);
    at::globalContext().setAllowTF32CuDNN(cudnn);
  }
};

// Two stages on one GPU, each on a stream of its own: the gradients of the whole model.
TEST(Cuda, PipelineTwoStagesOnOneGpuWithStreams_CUDA) {
  REQUIRE_GPU();
  NoTF32 fp32;
  auto x = at::randn({10, 8}), y = at::randn({10, 4});
  auto exact = small_model_exact(x, y);
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
    testing::expect_gradients_within_rounding(got, exact, small_model_terms(10, 2 * 3),
                                              sched == PipelineSchedule::kGPipe ? "GPipe" : "1F1B");
  }
}

TEST(Cuda, DataParallelTwoReplicasOnOneGpu_CUDA) {
  REQUIRE_GPU();
  NoTF32 fp32;
  auto x = at::randn({9, 8}), y = at::randn({9, 4});
  auto exact = small_model_exact(x, y);
  const at::Device gpu(at::kCUDA, 0);
  DataParallel dp(small_model(), {gpu, gpu});
  dp.train_step(x.to(gpu), y.to(gpu), mse);
  std::vector<at::Tensor> got;
  for (auto& p : dp.parameters()) got.push_back(p.grad().cpu());
  testing::expect_gradients_within_rounding(got, exact, small_model_terms(9, 2 * 2), "cuda,cuda");
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
  o.device = at::kCUDA;
  o.amp = Amp::kFp16;
  o.out_dir = ::testing::TempDir() + "/scaletrain_cuda_trainer";
  o.resume = Resume::none();
  TrainResult r;
  auto errors = testing::run_ranks(
      1, [&](Dist& d) { r = train(o, d); }, std::chrono::seconds(60), "nccl");
  ASSERT_EQ(errors, std::vector<std::string>{""});
  EXPECT_EQ(r.device, "cuda:0");
  EXPECT_GT(r.peak_memory_bytes, 0);
  EXPECT_EQ(r.global_step, 8);
}

// Issue: an fp16 run resumed with a fresh loss scale, so it was not exact. The GradScaler's state
// travels in the checkpoint: killed mid-run and resumed, the weights are the uninterrupted run's
// bit for bit (an MLP: cuBLAS's products are deterministic, unlike some cuDNN convolutions).
TEST(Cuda, Fp16ResumeIsExact_CUDA) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "scaletrain_cuda_fp16_resume";
  fs::remove_all(dir);
  auto run = [&](const std::string& name, const std::string& env) {
    auto r = testing::run_command(
        env + " " + testing::cli_path() + " run --nproc-per-node 1 --master-port 0 " +
            "--max-restarts 1 -- " + testing::cli_path() +
            " train --device cuda --amp fp16 --model mlp --dataset synthetic --limit-train 384"
            " --limit-test 64 --epochs 2 --batch-size 64 --checkpoint-every 2 --no-progress"
            " --out " +
            (dir / name).string() + " 2>&1",
        300);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    Model m = make_model("mlp");
    load_weights((dir / name / "model.pt").string(), *m.module);
    return m.module->parameters();
  };
  auto straight = run("straight", ""), resumed = run("killed", "SCALETRAIN_KILL_AT_STEP=9");
  ASSERT_EQ(straight.size(), resumed.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(at::equal(straight[i], resumed[i])) << "parameter " << i;
  }
  fs::remove_all(dir);
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
  state.run_id = "gpu";
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
// stages on cuda:0 (one chunk, two streams), gives the single-device model's loss and gradients:
// both against the exact float64 ones (batch norm in eval mode, Note [Tolerances]).
TEST(Cuda, ResNetModelParallelOnOneGpuEqualsOneDevice_CUDA) {
  REQUIRE_GPU();
  NoTF32 fp32;
  torch::manual_seed(2);
  Model whole = make_model("resnet18");
  whole.module->eval();  // BatchNorm with running statistics: identical on both sides
  auto x = at::randn({6, 1, 28, 28}), y = at::randn({6, 10});
  auto zoo = testing::zoo_reference("resnet18", {}, /*eval=*/true);
  auto exact =
      testing::exact_and_magnitudes(zoo.make, zoo.forward, testing::weights_of(*whole.module), x,
                                    testing::mse_gradient(y), testing::buffers_of(*whole.module));
  // Terms: the forward and backward chains of every weight, conv1's weight gradient over the
  // batch's 6 x 28 x 28 output pixels, the loss.
  const double terms = testing::forward_terms(*whole.module) +
                       testing::backward_terms(*whole.module) + 6 * 28 * 28 + 3;
  torch::manual_seed(2);
  Model split = make_model("resnet18");
  split.module->eval();
  whole.module->to(at::kCUDA);
  const at::Device gpu(at::kCUDA, 0);
  auto lw = mse(whole.forward(x.to(gpu)), y.to(gpu));
  lw.backward();
  auto seq = as_sequential(split);
  PipelineOptions o;
  const int n = static_cast<int>(seq->size());
  o.balance = {n / 2, n - n / 2};
  o.devices = {gpu, gpu};
  Pipeline mp(seq, o);
  auto loss = mp.train_step(x.to(gpu), y.to(gpu), mse);
  auto value = testing::mse_value(exact, y);
  EXPECT_TRUE(testing::within_rounding(loss, value.exact, value.magnitude, terms)) << "pipeline";
  EXPECT_TRUE(testing::within_rounding(lw, value.exact, value.magnitude, terms)) << "one device";
  std::vector<at::Tensor> got, one;
  for (auto& p : split.module->parameters()) got.push_back(p.grad().cpu());
  for (auto& p : whole.module->parameters()) one.push_back(p.grad().cpu());
  testing::expect_gradients_within_rounding(got, exact, terms, "pipeline");
  testing::expect_gradients_within_rounding(one, exact, terms, "one device");
}

// ZeRO's three stages at world size 1 over NCCL on cuda:0 train the model DDP trains: the same
// steps on the same batches (one rank: nothing to reduce), so every weight agrees with DDP's to
// the rounding of the optimizer's elementwise formula, a few float32 ulps per step, 12 steps.
TEST(Cuda, ZeroStagesOverNcclAtWorldOneTrainLikeDdp_CUDA) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "scaletrain_cuda_zero_nccl";
  fs::remove_all(dir);
  auto run = [&](const std::string& strategy) {
    auto r = testing::run_command(
        testing::cli_path() + " run --nproc-per-node 1 --master-port 0 -- " + testing::cli_path() +
            " train --device cuda --backend nccl --strategy " + strategy +
            " --model mlp --dataset synthetic --limit-train 384 --limit-test 64 --epochs 2"
            " --batch-size 64 --no-progress --no-tensorboard --out " +
            (dir / strategy).string() + " 2>&1",
        300);
    EXPECT_EQ(r.exit_code, 0) << strategy << ": " << r.output;
    Model m = make_model("mlp");
    load_weights((dir / strategy / "model.pt").string(), *m.module);
    return m.module->parameters();
  };
  const auto ddp = run("ddp");
  const double steps = 12, eps = std::ldexp(1.0, -24);
  for (const std::string strategy : {"zero1", "zero2", "fsdp"}) {
    const auto got = run(strategy);
    ASSERT_EQ(got.size(), ddp.size()) << strategy;
    for (size_t i = 0; i < got.size(); ++i) {
      const double bound = 4 * steps * eps * (ddp[i].abs().max().item<double>() + 1e-3);
      EXPECT_LE((got[i] - ddp[i]).abs().max().item<double>(), bound)
          << strategy << ", parameter " << i;
    }
  }
  fs::remove_all(dir);
}

// A fresh `dir` holding 400 lines of text, `line(i)` each, and their bytes as token files in
// dir/tokens (`scaletrain data text`).
void text_tokens(const std::filesystem::path& dir, const std::function<std::string(int)>& line) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    std::ofstream text(dir / "text.txt");
    for (int i = 0; i < 400; ++i) text << line(i) << "\n";
  }
  auto data = testing::run_command(testing::cli_path() + " data text --input " +
                                   (dir / "text.txt").string() + " --out " +
                                   (dir / "tokens").string() + " 2>&1");
  EXPECT_EQ(data.exit_code, 0) << data.output;
}

// The transformer path on the GPU: gpt-tiny on bytes of text under bf16 autocast, with its
// blocks recomputed in backward, over NCCL at world size 1; the loss falls from log(256) and
// the run reports tokens/s and the peak memory of cuda:0.
TEST(Cuda, GptTrainsInBf16WithCheckpointedBlocks_CUDA) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "scaletrain_cuda_gpt";
  text_tokens(dir, [](int i) {
    return "the quick brown fox jumps over the lazy dog " + std::to_string(i);
  });
  ASSERT_FALSE(HasFailure());
  auto r = testing::run_command(
      testing::cli_path() + " run --nproc-per-node 1 --master-port 0 -- " + testing::cli_path() +
          " train --device cuda --model gpt-tiny --dataset text --data-dir " +
          (dir / "tokens").string() +
          " --amp bf16 --checkpoint-blocks --optimizer adam --lr 3e-3 --epochs 3 --batch-size 16"
          " --no-progress --no-tensorboard --out " +
          (dir / "run").string() + " 2>&1",
      300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cuda:0"), std::string::npos) << r.output;
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  std::string line, last;
  while (std::getline(metrics, line)) {
    if (line.find("\"kind\":\"epoch\"") != std::string::npos) last = line;
  }
  const auto at = last.find("\"loss\":");
  ASSERT_NE(at, std::string::npos) << last;
  EXPECT_LT(std::stod(last.substr(at + 7)), 0.8 * std::log(256.0)) << last;
  fs::remove_all(dir);
}

// Tensor parallelism on the GPU: two processes share cuda:0 over Gloo (NCCL takes one rank per
// GPU), --tp 2 with and without the sequence split, and train gpt-tiny on text to the weights of
// one process at --tp 1: 4 SGD steps (lr 0.1, no momentum), the same batches (one replica). The
// split layers sum their halves in another order, so a weight may differ by the rounding of its
// gradient's sums: their longest chains (the batch's 1024 tokens, the MLP's 256 fan-in, the 256
// logits) are under 2^14 terms, each step's change is at most the whole change |dw| in size, and
// the update rounds 4 times a step. A missing all-reduce in the row-parallel layers or a missing
// reduce-scatter in the sequence split is off by the size of the change itself.
TEST(Cuda, TensorParallelTwoProcessesShareOneGpuOverGloo_CUDA) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "scaletrain_cuda_tp_gloo";
  text_tokens(dir,
              [](int i) { return "a stitch in time saves nine, " + std::to_string(i * 7919); });
  ASSERT_FALSE(HasFailure());
  torch::manual_seed(3);
  Model start = make_model("gpt-tiny");
  save_weights((dir / "start.pt").string(), *start.module);
  auto train_with = [&](int procs, const std::string& flags) {
    const fs::path out = dir / ("run" + std::to_string(procs) + (flags.empty() ? "" : "sp"));
    auto r = testing::run_command(
        testing::cli_path() + " train --nproc-per-node " + std::to_string(procs) + " --tp " +
            std::to_string(procs) + flags +
            " --device cuda --backend gloo --model gpt-tiny --dataset text --data-dir " +
            (dir / "tokens").string() +
            " --limit-train 64 --limit-test 16 --epochs 1 --batch-size 16 --optimizer sgd"
            " --lr 0.1 --momentum 0 --weight-decay 0 --no-progress --no-tensorboard"
            " --resume none --init-weights " +
            (dir / "start.pt").string() + " --out " + out.string() + " 2>&1",
        240);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    Model m = make_model("gpt-tiny");
    load_weights((out / "model.pt").string(), *m.module);
    std::map<std::string, at::Tensor> w;
    for (const auto& p : m.module->named_parameters()) w[p.key()] = p.value().detach().clone();
    return w;
  };
  const auto one = train_with(1, "");
  const double steps = 4, eps = std::ldexp(1.0, -24), terms = 1 << 14;
  for (const std::string flags : {"", " --sequence-parallel"}) {
    const auto two = train_with(2, flags);
    for (const auto& p : start.module->named_parameters()) {
      const auto& want = one.at(p.key());
      const double change = (want - p.value()).abs().max().item<double>();
      const double bound = terms * eps * change + 4 * steps * eps * want.abs().max().item<double>();
      const double err = (two.at(p.key()) - want).abs().max().item<double>();
      EXPECT_LE(err, bound) << "--tp 2" << flags << ": " << p.key() << " (changed by " << change
                            << ")";
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace scaletrain
