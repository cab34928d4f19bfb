// Suite `pipeline-bubble`: the measured bubble of the in-process pipeline against the theory
// (p-1)/(m+p-1), for GPipe and 1F1B. Two stages of equal work (Linear layers) on `cpu,cpu`,
// one thread per stage and one intra-op thread each, so each stage owns a core. The same model
// on one stage is the baseline: a pipeline of p balanced stages ideally takes 1/p of it per step
// plus the bubble, so measured bubble = 1 - T_one_stage / (p * T_pipeline).

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <chrono>

#include "scaletrain/pipeline.h"
#include "scaletrain/schedule.h"
#include "suites_internal.h"

namespace scaletrain::bench {

torch::nn::Sequential linear_tanh_stack(int layers, int64_t width) {
  torch::manual_seed(0);
  torch::nn::Sequential s;
  for (int i = 0; i < layers; ++i) {
    s->push_back(torch::nn::Linear(width, width));
    s->push_back(torch::nn::Tanh());
  }
  return s;
}

namespace {

double time_step(Pipeline& pipe, const at::Tensor& x, const at::Tensor& y, int repeats,
                 std::vector<double>* all) {
  auto mse = [](const at::Tensor& o, const at::Tensor& t) {
    return torch::nn::functional::mse_loss(o, t);
  };
  pipe.train_step(x, y, mse);  // warm-up
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    pipe.train_step(x, y, mse);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (all) all->push_back(s);
    best = std::min(best, s);
  }
  return best;
}

}  // namespace

SuiteResult run_pipeline_bubble(const SuiteOptions& o) {
  const std::string title = "Pipeline bubble, 2 stages on cpu,cpu: measured vs (p-1)/(m+p-1)";
  SuiteResult r =
      new_result("pipeline-bubble", title, "fraction",
                 {Plot::Kind::kLines, title, "micro-batches m", "bubble fraction", true, false}, o);
  IntraOpThreads one_thread(1);
  const int p = 2, layers = 8;
  const int64_t width = o.quick ? 256 : 512, batch = o.quick ? 512 : 1024;
  auto x = at::randn({batch, width}), y = at::randn({batch, width});
  const std::vector<int> ms = {1, 2, 4, 8, 16};
  std::vector<double> base_times;
  PipelineOptions one;
  one.balance = {2 * layers};
  one.devices = {at::kCPU};
  Pipeline base(linear_tanh_stack(layers, width), one);
  for (int m : ms) {
    one.chunks = m;
    Pipeline b(linear_tanh_stack(layers, width), one);
    base_times.push_back(time_step(b, x, y, o.repeats, nullptr));
  }
  for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    const std::string name = sched == PipelineSchedule::kGPipe ? "GPipe" : "1F1B";
    for (size_t k = 0; k < ms.size(); ++k) {
      PipelineOptions po;
      po.balance = {layers, layers};
      po.devices = {at::kCPU, at::kCPU};
      po.chunks = ms[k];
      po.schedule = sched;
      Pipeline pipe(linear_tanh_stack(layers, width), po);
      std::vector<double> times;
      time_step(pipe, x, y, o.repeats, &times);
      Sample s{name + " measured", std::to_string(ms[k]), static_cast<double>(ms[k]), {}};
      for (double t : times) s.values.push_back(1.0 - base_times[k] / (p * t));
      r.samples.push_back(s);
    }
  }
  for (int m : ms) {
    r.samples.push_back({"theory (p-1)/(m+p-1)",
                         std::to_string(m),
                         static_cast<double>(m),
                         {bubble_fraction(p, m)}});
  }
  r.notes.push_back("Model: " + std::to_string(2 * layers) + " Linear+Tanh layers of width " +
                    std::to_string(width) + ", batch " + std::to_string(batch) +
                    ", MSE loss; baseline: the same model as one stage with the same "
                    "micro-batches. Measured bubble = 1 - T_one_stage / (2 T_pipeline), per "
                    "repetition.");
  return r;
}

}  // namespace scaletrain::bench
