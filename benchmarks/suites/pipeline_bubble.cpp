// Suite `pipeline-bubble`: the measured bubble of the in-process pipeline against each
// schedule's theory, for GPipe, 1F1B, interleaved 1F1B and zero bubble H1. Two stages of equal work
// (Linear layers) on `cpu,cpu`, one thread per stage and one intra-op thread each, so each stage
// owns a core. The same model on one stage is the baseline: a pipeline of p balanced stages ideally
// takes 1/p of it per step plus the bubble, so measured bubble = 1 - T_one_stage / (p *
// T_pipeline).

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <functional>

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

double one_stage_step_time(int layers, const at::Tensor& x, const at::Tensor& y, int m,
                           int repeats) {
  PipelineOptions one;
  one.balance = {2 * layers};
  one.devices = {at::kCPU};
  one.chunks = m;
  Pipeline b(linear_tanh_stack(layers, x.size(1)), one);
  return time_step(b, x, y, repeats, nullptr);
}

namespace {

// A schedule as the suite runs it: `per_device` stages on each device, its theory's bubble by m.
struct Sched {
  PipelineSchedule schedule;
  std::string name;
  int per_device;
  std::function<double(int)> theory;
};

// The theory's bubble of each schedule at each m it runs (GPipe's series would repeat 1F1B's).
void add_theory_samples(SuiteResult& r, const std::vector<Sched>& scheds,
                        const std::vector<int>& ms, int p) {
  for (const auto& sc : scheds) {
    if (sc.schedule == PipelineSchedule::kGPipe) continue;  // 1F1B's theory is GPipe's
    for (int m : ms) {
      if (m % (sc.per_device > 1 ? p : 1) != 0) continue;
      r.samples.push_back(
          {"theory, " + sc.name, std::to_string(m), static_cast<double>(m), {sc.theory(m)}});
    }
  }
}

}  // namespace

SuiteResult run_pipeline_bubble(const SuiteOptions& o) {
  const std::string title =
      "Pipeline bubble, 2 devices (cpu,cpu): measured vs each schedule's theory";
  SuiteResult r =
      new_result("pipeline-bubble", title, "fraction",
                 {Plot::Kind::kLines, title, "micro-batches m", "bubble fraction", true, false}, o);
  IntraOpThreads one_thread(1);
  const int p = 2, layers = 8;
  const int64_t width = o.quick ? 256 : 512, batch = o.quick ? 512 : 1024;
  auto x = at::randn({batch, width}), y = at::randn({batch, width});
  const std::vector<int> ms = {1, 2, 4, 8, 16, 32};
  std::vector<double> base_times;
  for (int m : ms) base_times.push_back(one_stage_step_time(layers, x, y, m, o.repeats));
  const std::vector<Sched> scheds = {
      {PipelineSchedule::kGPipe, "GPipe", 1, [&](int m) { return bubble_fraction(p, m); }},
      {PipelineSchedule::k1F1B, "1F1B", 1, [&](int m) { return bubble_fraction(p, m); }},
      {PipelineSchedule::kInterleaved1F1B, "interleaved 1F1B (v=2)", 2,
       [&](int m) { return interleaved_bubble_fraction(p, 2, m); }},
      {PipelineSchedule::kZeroBubbleH1, "zero bubble H1", 1,
       [&](int m) { return zero_bubble_h1_bubble_fraction(p, m); }},
  };
  // Of ideal: the step time the schedule's theory gives, T_one_stage / p / (1 - bubble), over
  // the measured one (1.0: the theory reached).
  std::string table = "| schedule | theory / measured step time at m = ";
  for (size_t k = 0; k < ms.size(); ++k) {
    table += (k ? ", " : "") + std::to_string(ms[k]);
  }
  table += " |\n|---|---|\n";
  for (const auto& sc : scheds) {
    std::string row = "| " + sc.name + " | ";
    for (size_t k = 0; k < ms.size(); ++k) {
      if (ms[k] % (sc.per_device > 1 ? p : 1) != 0) {
        row += "- ";
        continue;
      }
      PipelineOptions po;
      po.stages_per_device = sc.per_device;
      po.balance.assign(static_cast<size_t>(p * sc.per_device), layers / sc.per_device);
      po.devices = {at::kCPU, at::kCPU};
      po.chunks = ms[k];
      po.schedule = sc.schedule;
      Pipeline pipe(linear_tanh_stack(layers, width), po);
      std::vector<double> times;
      time_step(pipe, x, y, o.repeats, &times);
      Sample s{sc.name + " measured", std::to_string(ms[k]), static_cast<double>(ms[k]), {}};
      for (double t : times) s.values.push_back(1.0 - base_times[k] / (p * t));
      const double ideal = base_times[k] / p / (1.0 - sc.theory(ms[k]));
      char cell[32];
      std::snprintf(cell, sizeof cell, "%.2f ", ideal / stats(times).mean);
      row += cell;
      r.samples.push_back(s);
    }
    table += row + "|\n";
  }
  add_theory_samples(r, scheds, ms, p);
  r.notes.push_back("Model: " + std::to_string(2 * layers) + " Linear+Tanh layers of width " +
                    std::to_string(width) + ", batch " + std::to_string(batch) +
                    ", MSE loss, 2 devices with a core each (interleaved: 4 stages, 2 per "
                    "device); baseline: the same model as one stage with the same micro-batches. "
                    "Measured bubble = 1 - T_one_stage / (2 T_pipeline), per repetition. Theory: "
                    "(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved, (p-1)/(3m+p-1) "
                    "zero bubble H1 (F, I and W of equal cost, as for Linear layers).");
  r.notes.push_back(
      "Each schedule's step time against its theory's (T_one_stage / p / (1 - "
      "bubble); 1.00 = the theory reached, mean of the repetitions):\n\n" +
      table);
  return r;
}

}  // namespace scaletrain::bench
