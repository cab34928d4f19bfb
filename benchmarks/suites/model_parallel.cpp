// Suites `mp-vs-single` and `split-sweep` (seed 000): ResNet-50 on random data, trained on one
// device, split over two devices (model parallel: the seed's split, stem to layer2 | layer3 to
// fc), and pipelined with micro-batches of `split size` samples. The seed runs this on two
// GPUs; here the two devices are `cpu,cpu`, each stage one thread with one intra-op thread, so
// each owns a core the way each GPU is a device of its own.

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <functional>
#include <memory>

#include "scaletrain/model.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/version.h"
#include "suites_internal.h"
#include "zoo_models.h"

namespace scaletrain::bench {
namespace {

struct Setup {
  int64_t batch, image, classes;
  int batches;  // optimizer steps per timed run, as the seed's num_batches
  std::vector<at::Device> devices;
  at::Tensor x, y;  // the random batch every configuration trains on
};

Setup setup_for(const SuiteOptions& o) {
  Setup s;
  const int gpus = cuda_device_count();
  if (gpus >= 2) {
    s.devices = {at::Device(at::kCUDA, 0), at::Device(at::kCUDA, 1)};
  } else if (gpus == 1) {
    s.devices = {at::Device(at::kCUDA, 0), at::Device(at::kCUDA, 0)};
  } else {
    s.devices = {at::kCPU, at::kCPU};
  }
  const bool small = o.quick || s.devices[0].is_cpu();
  s.batch = small ? 24 : 120;  // the seed: 120 images of 224x224, 1000 classes, 3 batches
  s.image = small ? 64 : 224;
  s.classes = 1000;
  s.batches = small ? 1 : 3;
  s.x = at::randn({s.batch, 3, s.image, s.image});
  s.y = at::randint(s.classes, {s.batch}, at::kLong);
  return s;
}

// ResNet-50 as blocks: stem, 16 bottlenecks, head. The seed's split in block terms: stem +
// layer1 (3) + layer2 (4) | the rest.
constexpr int kBlocks = 1 + 16 + 1;
constexpr int kFirstStageBlocks = 1 + 3 + 4;

// One configuration, built once (its model placed, its optimizer made). Each call of the
// returned function times s.batches SGD steps on it, as the Python peer (gpu_peer.py resnet50)
// times repeats of one model after a warm-up.
std::function<double()> steps_on(const Setup& s, const std::vector<int>& balance,
                                 const std::vector<at::Device>& devices, int chunks) {
  ModelOptions mo;
  mo.in_channels = 3;
  mo.num_classes = s.classes;
  torch::manual_seed(0);
  Model m = make_model("resnet50", mo);
  // Channels-last weights and batch, as the trainer runs convolutions by default and as the
  // Python peer does.
  to_channels_last(*m.module);
  PipelineOptions po;
  po.balance = balance;
  po.devices = devices;
  po.chunks = chunks;
  auto pipe = std::make_shared<Pipeline>(as_sequential(m), po);
  std::vector<at::Tensor> params;
  for (auto& st : pipe->stages()) {
    for (auto& p : st->parameters()) params.push_back(p);
  }
  auto opt = std::make_shared<torch::optim::SGD>(params, 0.001);
  const at::Tensor x = s.x.contiguous(at::MemoryFormat::ChannelsLast), y = s.y;
  const int batches = s.batches;
  return [pipe, opt, x, y, batches, devices] {
    auto loss = [](const at::Tensor& out, const at::Tensor& t) {
      return torch::nn::functional::cross_entropy(out, t);
    };
    auto t0 = std::chrono::steady_clock::now();
    for (int b = 0; b < batches; ++b) {
      opt->zero_grad();
      pipe->train_step(x, y, loss);
      opt->step();
    }
    for (auto& d : devices) {
      if (d.is_cuda()) torch::cuda::synchronize(d.index());
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
}

// The whole model on the first device, or split the seed's way over both; `chunks`
// micro-batches.
std::function<double()> on_one_device(const Setup& s, int chunks) {
  return steps_on(s, {kBlocks}, {s.devices[0]}, chunks);
}
std::function<double()> on_two_devices(const Setup& s, int chunks) {
  return steps_on(s, {kFirstStageBlocks, kBlocks - kFirstStageBlocks}, s.devices, chunks);
}

// Repetitions of one configuration, after a warm-up run.
std::vector<double> repeat(int repeats, const std::function<double()>& run) {
  run();
  std::vector<double> out;
  for (int r = 0; r < repeats; ++r) out.push_back(run());
  return out;
}

std::string describe(const Setup& s) {
  return "ResNet-50 (torchvision's layout, " + std::to_string(s.classes) + " classes), random " +
         std::to_string(s.image) + "x" + std::to_string(s.image) + " images, batch " +
         std::to_string(s.batch) + ", " + std::to_string(s.batches) +
         " SGD step(s) per run (one model per configuration, after a warm-up run), channels-last; "
         "devices " +
         s.devices[0].str() + "," + s.devices[1].str() +
         "; split: stem..layer2 | layer3..fc (the seed's).";
}

}  // namespace

SuiteResult run_mp_vs_single(const SuiteOptions& o) {
  const std::string title = "ResNet-50: single device vs model parallel vs pipelined (seed 000)";
  SuiteResult r = new_result("mp-vs-single", title, "s",
                             {Plot::Kind::kBars, title, "", "seconds per run", false, false}, o);
  const Setup s = setup_for(o);
  IntraOpThreads threads(s.devices[0].is_cpu() ? 1 : at::get_num_threads());
  const int split = s.batch / 6;  // the seed's split size 20 of 120
  const int reps = o.quick ? std::min(o.repeats, 3) : o.repeats;
  Sample single{"seconds", "single device", 0, {}};
  Sample mp{"seconds", "model parallel", 1, {}};
  Sample piped{"seconds", "pipelined (split " + std::to_string(split) + ")", 2, {}};
  const int chunks = static_cast<int>(s.batch / split);
  single.values = repeat(reps, on_one_device(s, 1));
  mp.values = repeat(reps, on_two_devices(s, 1));
  // The same micro-batches on one device: what splitting the batch costs by itself, so that
  // pipelined vs this shows what overlapping the two stages gains.
  Sample single_split{"seconds", "single device, same micro-batches", 3, {}};
  single_split.values = repeat(reps, on_one_device(s, chunks));
  piped.values = repeat(reps, on_two_devices(s, chunks));
  r.samples = {single, mp, piped, single_split};
  const double ts = stats(single.values).mean, tm = stats(mp.values).mean,
               tp = stats(piped.values).mean, tss = stats(single_split.values).mean;
  char line[400];
  std::snprintf(line, sizeof line,
                "Model parallel takes %.2fx the single-device time (the seed: slower, since only "
                "one device works at a time, plus copies); pipelining takes %.2fx of model "
                "parallel's. Micro-batching alone costs %.2fx on one device; against that, "
                "pipelining over two devices takes %.2fx.",
                tm / ts, tp / tm, tss / ts, tp / tss);
  r.notes = {describe(s), line};
  return r;
}

SuiteResult run_split_sweep(const SuiteOptions& o) {
  const std::string title = "Pipelined ResNet-50: time per run vs split size (seed 000)";
  SuiteResult r = new_result("split-sweep", title, "s",
                             {Plot::Kind::kLines, title, "split size (samples per micro-batch)",
                              "seconds per run", true, false},
                             o);
  const Setup s = setup_for(o);
  IntraOpThreads threads(s.devices[0].is_cpu() ? 1 : at::get_num_threads());
  const std::vector<int> splits = s.batch == 120 ? std::vector<int>{1, 3, 5, 8, 10, 12, 20, 40, 60}
                                                 : std::vector<int>{1, 2, 3, 4, 6, 8, 12};
  const int reps = o.quick ? std::min(o.repeats, 2) : o.repeats;
  double best = 1e30;
  int best_split = 0;
  for (int split : splits) {
    const int chunks = static_cast<int>((s.batch + split - 1) / split);
    Sample p{"pipelined", std::to_string(split), static_cast<double>(split), {}};
    p.values = repeat(reps, on_two_devices(s, chunks));
    const double mean = stats(p.values).mean;
    if (mean < best) best = mean, best_split = split;
    r.samples.push_back(p);
  }
  Sample mp{
      "model parallel (no pipelining)", std::to_string(s.batch), static_cast<double>(s.batch), {}};
  mp.values = repeat(reps, on_two_devices(s, 1));
  r.samples.push_back(mp);
  char line[300];
  std::snprintf(line, sizeof line,
                "Best split size %d: %.3f s per run, %.2fx faster than model parallel without "
                "pipelining (%.3f s). Small splits pay per-micro-batch overhead; large ones leave "
                "a device idle.",
                best_split, best, stats(mp.values).mean / best, stats(mp.values).mean);
  r.notes = {describe(s), line};
  return r;
}

}  // namespace scaletrain::bench
