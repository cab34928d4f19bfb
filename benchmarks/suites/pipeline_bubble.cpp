// Suite `pipeline-bubble`: the measured bubble of the in-process pipeline against each
// schedule's theory, for GPipe, 1F1B, interleaved 1F1B and zero bubble H1. Two stages of equal work
// (Linear layers) on `cpu,cpu`, one thread per stage and one intra-op thread each, so each stage
// owns a core. The same model on one stage is the baseline: a pipeline of p balanced stages ideally
// takes 1/p of it per step plus the bubble, so measured bubble = 1 - T_one_stage / (p *
// T_pipeline). Beside each step, the same-moment control (as pipeline-ranks has): each device's
// thread computes its stages' forwards and backwards of the step's micro-batches at the same
// time as the other's, with no hand-off and no schedule. Against it the ideal step is
// T_control / (1 - bubble), what the pipeline would take if its hand-offs cost nothing on this
// machine as loaded at that moment; the gap to it is the hand-offs' and the stage threads' own.

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

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

double time_step(Pipeline& pipe, const at::Tensor& x, const at::Tensor& y, int repeats) {
  auto mse = [](const at::Tensor& o, const at::Tensor& t) {
    return torch::nn::functional::mse_loss(o, t);
  };
  pipe.train_step(x, y, mse);  // warm-up
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    pipe.train_step(x, y, mse);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
  }
  return best;
}

// The control's work: each device's share of the model (its stages' layers back to back) and
// the micro-batches, computed by a thread per device at once.
class Control {
 public:
  Control(int devices, int layers_per_device, int64_t width) {
    for (int d = 0; d < devices; ++d)
      stages_.push_back(linear_tanh_stack(layers_per_device, width));
  }

  // Seconds from the moment every thread is ready to the last one's end.
  double time(const at::Tensor& x, const at::Tensor& y, int m) {
    const auto xs = x.chunk(m), ys = y.chunk(m);
    const int n = static_cast<int>(stages_.size());
    std::atomic<int> ready{0};
    std::atomic<int64_t> start_ns{0};
    std::vector<std::thread> threads;
    for (int d = 0; d < n; ++d) {
      threads.emplace_back([&, d] {
        if (++ready == n) start_ns = now_ns();
        while (ready.load() < n) std::this_thread::yield();
        for (size_t i = 0; i < xs.size(); ++i) {
          // A later stage's input takes a gradient, as the pipeline's does (it sends it back).
          auto in = xs[i].detach().requires_grad_(d > 0);
          torch::nn::functional::mse_loss(stages_[static_cast<size_t>(d)]->forward(in), ys[i])
              .backward();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& s : stages_) s->zero_grad();
    return static_cast<double>(now_ns() - start_ns.load()) * 1e-9;
  }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  std::vector<torch::nn::Sequential> stages_;
};

}  // namespace

double one_stage_step_time(int layers, const at::Tensor& x, const at::Tensor& y, int m,
                           int repeats) {
  PipelineOptions one;
  one.balance = {2 * layers};
  one.devices = {at::kCPU};
  one.chunks = m;
  Pipeline b(linear_tanh_stack(layers, x.size(1)), one);
  return time_step(b, x, y, repeats);
}

namespace {

// A schedule as the suite runs it: `per_device` stages on each device, its theory's bubble by m.
struct Sched {
  PipelineSchedule schedule;
  std::string name;
  int per_device;
  std::function<double(int)> theory;
};

// One schedule at one m: its step times, each followed by the control's.
struct Timed {
  std::vector<double> steps, controls;
};

Timed time_schedule(const Sched& sc, int p, int layers, const at::Tensor& x, const at::Tensor& y,
                    int m, int repeats, Control& control) {
  PipelineOptions po;
  po.stages_per_device = sc.per_device;
  po.balance.assign(static_cast<size_t>(p * sc.per_device), layers / sc.per_device);
  po.devices = {at::kCPU, at::kCPU};
  po.chunks = m;
  po.schedule = sc.schedule;
  Pipeline pipe(linear_tanh_stack(layers, x.size(1)), po);
  auto mse = [](const at::Tensor& o, const at::Tensor& t) {
    return torch::nn::functional::mse_loss(o, t);
  };
  pipe.train_step(x, y, mse);  // warm-up, both
  control.time(x, y, m);
  Timed t;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pipe.train_step(x, y, mse);
    t.steps.push_back(seconds_since(t0));
    t.controls.push_back(control.time(x, y, m));
  }
  return t;
}

std::string cell(double v) {
  char c[32];
  std::snprintf(c, sizeof c, "%.2f ", v);
  return c;
}

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
  // Of ideal: the step time the schedule's theory gives over the measured one (1.0: the theory
  // reached), against the one-stage baseline (T_one_stage / p / (1 - bubble)) and against the
  // same-moment control (T_control / (1 - bubble)), repetition by repetition.
  std::string ms_text;
  for (size_t k = 0; k < ms.size(); ++k) ms_text += (k ? ", " : "") + std::to_string(ms[k]);
  std::string table = "| schedule | against the one-stage baseline, m = " + ms_text +
                      " | against the same-moment control |\n|---|---|---|\n";
  Control control(p, layers / p, width);
  for (const auto& sc : scheds) {
    std::string base_row, control_row;
    for (size_t k = 0; k < ms.size(); ++k) {
      if (ms[k] % (sc.per_device > 1 ? p : 1) != 0) {
        base_row += "- ";
        control_row += "- ";
        continue;
      }
      const Timed t = time_schedule(sc, p, layers, x, y, ms[k], o.repeats, control);
      Sample s{sc.name + " measured", std::to_string(ms[k]), static_cast<double>(ms[k]), {}};
      for (double step : t.steps) s.values.push_back(1.0 - base_times[k] / (p * step));
      r.samples.push_back(s);
      const double keep = 1.0 - sc.theory(ms[k]);
      base_row += cell(base_times[k] / p / keep / stats(t.steps).mean);
      double of_control = 0;
      for (size_t i = 0; i < t.steps.size(); ++i) of_control += t.controls[i] / keep / t.steps[i];
      control_row += cell(of_control / static_cast<double>(t.steps.size()));
    }
    table += "| " + sc.name + " | " + base_row + "| " + control_row + "|\n";
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
      "Each schedule's step time against its theory's: from the one-stage baseline (T_one_stage / "
      "p / (1 - bubble), over the mean step) and from the same-moment control (T_control / (1 - "
      "bubble), timed beside each step: two threads computing their stages' work at once without "
      "hand-offs; the mean of the repetitions' ratios). 1.00 = the theory reached:\n\n" +
      table);
  return r;
}

}  // namespace scaletrain::bench
