// Suite `loader`: can the input pipeline keep up? The Fashion-MNIST loader (shuffled indices,
// rows gathered into batches on a background thread) against the rate at which LeNet training
// consumes samples on one CPU thread — the per-process budget of `scaletrain train` on CPU.
// Target: the loader delivers at least 5x what training consumes.

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <filesystem>
#include <numeric>
#include <random>

#include "scaletrain/data.h"
#include "scaletrain/loader.h"
#include "suites_internal.h"
#include "zoo_models.h"

namespace scaletrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

SuiteResult run_loader(const SuiteOptions& o) {
  const std::string title = "Fashion-MNIST loader vs LeNet training, samples/s (1 thread)";
  SuiteResult r = new_result("loader", title, "samples/s",
                             {Plot::Kind::kBars, title, "", "samples per second", false, true}, o);
  const bool real =
      std::filesystem::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz");
  auto data = std::make_shared<const Dataset>(real ? load_fashion_mnist(kFashionMnistDir, true)
                                                   : make_synthetic(60000, 1, 28, 28, 10, 1));
  const int64_t batch = 128;
  const int64_t n = o.quick ? 20480 : data->size();
  std::vector<int64_t> order(static_cast<size_t>(data->size()));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(0));
  order.resize(static_cast<size_t>(n));

  IntraOpThreads one_thread(1);
  Model lenet = make_model("lenet");
  torch::optim::SGD opt(lenet.module->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const int train_steps = o.quick ? 20 : 60;

  Sample inline_loader{"samples/s", "loader, inline", 0, {}};
  Sample threaded{"samples/s", "loader, 1 thread", 1, {}};
  Sample training{"samples/s", "LeNet training", 2, {}};
  auto drain = [&](int workers) {
    LoaderOptions lo;
    lo.batch_size = batch;
    lo.workers = workers;
    Loader loader(batches_of(data), order, lo);
    auto t0 = Clock::now();
    int64_t seen = 0;
    while (auto b = loader.next()) seen += b->targets.size(0);
    return static_cast<double>(seen) / seconds_since(t0);
  };
  for (int rep = 0; rep < o.repeats; ++rep) {
    inline_loader.values.push_back(drain(0));
    threaded.values.push_back(drain(1));
    LoaderOptions lo;
    lo.batch_size = batch;
    Loader loader(batches_of(data), order, lo);
    auto t0 = Clock::now();
    int64_t seen = 0;
    for (int s = 0; s < train_steps; ++s) {
      auto b = loader.next();
      auto loss = torch::nn::functional::cross_entropy(lenet.forward(b->inputs), b->targets);
      opt.zero_grad();
      loss.backward();
      opt.step();
      seen += b->targets.size(0);
    }
    training.values.push_back(static_cast<double>(seen) / seconds_since(t0));
  }
  r.samples = {inline_loader, threaded, training};
  const double ratio = stats(threaded.values).mean / stats(training.values).mean;
  char line[200];
  std::snprintf(line, sizeof line,
                "The loader (one background thread) delivers %.1fx the samples per second that "
                "LeNet training consumes (target: at least 5x). %s data, batch %lld.",
                ratio, real ? "Fashion-MNIST" : "Synthetic (Fashion-MNIST not installed)",
                static_cast<long long>(batch));
  r.notes.push_back(line);
  return r;
}

}  // namespace scaletrain::bench
