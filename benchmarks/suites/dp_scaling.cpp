// Suite `dp-scaling` (seed 003): the small-image ResNet-18 on Fashion-MNIST, one epoch on 1..N
// devices, with DistributedDataParallel (N processes through the launcher, `scaletrain train`)
// and with single-process DataParallel (N replicas, one thread each): seconds per epoch and
// test accuracy. On a CPU machine the devices are CPU cores: each process or replica gets one
// intra-op thread.

#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "scaletrain/data.h"
#include "scaletrain/data_parallel.h"
#include "scaletrain/error.h"
#include "scaletrain/sampler.h"
#include "scaletrain/version.h"
#include "suites_internal.h"
#include "zoo_models.h"

namespace scaletrain::bench {
namespace {

struct Config {
  int64_t limit_train, limit_test, batch;
  double lr = 0.05;
};

struct Outcome {
  double seconds = 0, accuracy = 0;
};

Outcome ddp_epoch(const SuiteOptions& o, const Config& c, int n,
                  const std::vector<std::string>& device) {
  const std::string out = o.work_dir + "/dp-scaling-ddp-" + std::to_string(n);
  std::filesystem::remove_all(out);
  std::vector<std::string> cmd = {o.self_exe,      "train",
                                  "--model",       "resnet18",
                                  "--epochs",      "1",
                                  "--limit-train", std::to_string(c.limit_train),
                                  "--limit-test",  std::to_string(c.limit_test),
                                  "--batch-size",  std::to_string(c.batch),
                                  "--lr",          std::to_string(c.lr),
                                  "--out",         out,
                                  "--resume",      "none",
                                  "--no-progress", "--no-tensorboard",
                                  "--log-every",   "0",
                                  "--workers",     "1"};
  cmd.insert(cmd.end(), device.begin(), device.end());
  run_local_ranks(o, n, cmd, "dp-scaling-ddp-" + std::to_string(n));
  std::ifstream metrics(out + "/metrics.jsonl");
  std::string line;
  Outcome r;
  while (std::getline(metrics, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") == "epoch") {
      r.seconds = j.at("seconds").get<double>();
      r.accuracy = j.at("test_accuracy").get<double>();
    }
  }
  if (r.seconds == 0) throw Error("no epoch line in " + out + "/metrics.jsonl");
  return r;
}

Outcome dp_epoch(const Config& c, const std::vector<at::Device>& devices, const Dataset& train,
                 const Dataset& test) {
  torch::manual_seed(0);
  DataParallel dp([] { return as_sequential(make_model("resnet18")); }, devices);
  torch::optim::SGD opt(dp.parameters(),
                        torch::optim::SGDOptions(c.lr).momentum(0.9).weight_decay(5e-4));
  DistributedSampler sampler({train.size(), 1, 0, true, 0, false});
  auto idx = sampler.indices();
  auto loss = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  auto t0 = std::chrono::steady_clock::now();
  for (size_t start = 0; start < idx.size(); start += static_cast<size_t>(c.batch)) {
    const size_t end = std::min(idx.size(), start + static_cast<size_t>(c.batch));
    auto [x, y] = gather_batch(
        train, {idx.begin() + static_cast<long>(start), idx.begin() + static_cast<long>(end)});
    opt.zero_grad();
    dp.train_step(x.to(devices[0]), y.to(devices[0]), loss);
    opt.step();
  }
  Outcome r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (auto& replica : dp.replicas()) replica->eval();
  torch::NoGradGuard no_grad;
  int64_t correct = 0;
  for (int64_t start = 0; start < test.size(); start += 256) {
    const int64_t len = std::min<int64_t>(256, test.size() - start);
    auto out = dp.forward(test.inputs.narrow(0, start, len).to(devices[0]));
    correct += out.argmax(1).cpu().eq(test.targets.narrow(0, start, len)).sum().item<int64_t>();
  }
  r.accuracy = static_cast<double>(correct) / static_cast<double>(test.size());
  return r;
}

}  // namespace

SuiteResult run_dp_scaling(const SuiteOptions& o) {
  const std::string title = "ResNet-18 on Fashion-MNIST: seconds per epoch on 1..N devices";
  SuiteResult r =
      new_result("dp-scaling", title, "s",
                 {Plot::Kind::kBars, title, "devices", "seconds per epoch", false, false}, o);
  const std::string dir = kFashionMnistDir;
  if (!std::filesystem::exists(dir + "/train-images-idx3-ubyte.gz")) {
    throw Error("dp-scaling needs Fashion-MNIST in " + dir + " (Debian's dataset-fashion-mnist)");
  }
  const int gpus = cuda_device_count();
  const int max_devices = gpus > 0 ? gpus : 2;
  const bool small = o.quick || gpus == 0;
  // The small-image ResNet-18 costs ~1.7 GFLOP per 28x28 image (forward and backward): on a
  // CPU thread that is ~0.1 s an image, so the CPU sizes are small.
  Config c{small ? (o.quick ? 128 : 2048) : 0, small ? (o.quick ? 128 : 1000) : 0,
           gpus > 0 ? 128 : 32};
  const int reps = o.quick ? 1 : std::min(o.repeats, 3);
  Dataset train = load_fashion_mnist(dir, true), test = load_fashion_mnist(dir, false);
  if (c.limit_train > 0) {
    train.inputs = train.inputs.narrow(0, 0, c.limit_train);
    train.targets = train.targets.narrow(0, 0, c.limit_train);
  }
  if (c.limit_test > 0) {
    test.inputs = test.inputs.narrow(0, 0, c.limit_test);
    test.targets = test.targets.narrow(0, 0, c.limit_test);
  }
  for (int n = 1; n <= max_devices; ++n) {
    Sample ddp{"DDP (processes)", std::to_string(n), static_cast<double>(n), {}};
    Sample dp{"DataParallel (one process)", std::to_string(n), static_cast<double>(n), {}};
    std::vector<at::Device> devices;
    for (int i = 0; i < n; ++i) {
      devices.push_back(gpus > 0 ? at::Device(at::kCUDA, static_cast<int8_t>(i))
                                 : at::Device(at::kCPU));
    }
    double ddp_acc = 0, dp_acc = 0;
    for (int rep = 0; rep < reps; ++rep) {
      Outcome a = ddp_epoch(
          o, c, n,
          gpus > 0 ? std::vector<std::string>{} : std::vector<std::string>{"--device", "cpu"});
      ddp.values.push_back(a.seconds);
      ddp_acc = a.accuracy;
      Outcome b = [&] {
        IntraOpThreads threads(gpus == 0 ? 1 : at::get_num_threads());
        return dp_epoch(c, devices, train, test);
      }();
      dp.values.push_back(b.seconds);
      dp_acc = b.accuracy;
    }
    r.samples.push_back(ddp);
    r.samples.push_back(dp);
    char line[200];
    std::snprintf(line, sizeof line,
                  "%d device(s): test accuracy after the epoch, DDP %.4f, "
                  "DataParallel %.4f.",
                  n, ddp_acc, dp_acc);
    r.notes.push_back(line);
  }
  r.notes.insert(r.notes.begin(),
                 "One epoch of " +
                     std::string(c.limit_train > 0 ? std::to_string(c.limit_train) : "60000") +
                     " training images, global batch " + std::to_string(c.batch) + ", SGD lr " +
                     std::to_string(c.lr).substr(0, 4) + " momentum 0.9; " +
                     (gpus > 0 ? "one GPU per device." : "one CPU thread per process or replica."));
  return r;
}

}  // namespace scaletrain::bench
