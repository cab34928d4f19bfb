// Suite `pipeline-ranks`: the bubble of the pipeline across processes (DistPipeline) against
// each schedule's theory, for GPipe, 1F1B, interleaved 1F1B (2 stages per rank) and zero bubble
// H1, with the stages' messages through shared memory (the default), and with --full through
// Gloo too, side by side. The model and the method are pipeline-bubble's (Linear+Tanh layers of
// equal work, one intra-op thread per process, so each rank owns a core): the same model as one
// stage in one process is the baseline, and each schedule's ideal step time is T_one_stage / p / (1
// − bubble), the baseline timed beside each step. What this adds over pipeline-bubble is the
// transport: every activation and gradient crosses a process boundary through the backend.

#include <torch/nn/functional/loss.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <optional>

#include "scaletrain/bench_suites.h"
#include "scaletrain/dist.h"
#include "scaletrain/dist_pipeline.h"
#include "scaletrain/error.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/schedule.h"
#include "suites_internal.h"

namespace scaletrain::bench {
namespace {

constexpr int kLayers = 8;  // Linear+Tanh pairs: 16 modules

at::Tensor mse(const at::Tensor& o, const at::Tensor& t) {
  return torch::nn::functional::mse_loss(o, t);
}

std::vector<int> microbatch_counts(bool quick) {
  return quick ? std::vector<int>{2, 4, 8} : std::vector<int>{2, 4, 8, 16, 32};
}

PipelineSchedule schedule_of(const std::string& s) {
  if (s == "gpipe") return PipelineSchedule::kGPipe;
  if (s == "1f1b") return PipelineSchedule::k1F1B;
  if (s == "interleaved") return PipelineSchedule::kInterleaved1F1B;
  if (s == "zb-h1") return PipelineSchedule::kZeroBubbleH1;
  throw UsageError("pipeline-ranks worker: unknown --schedule '" + s + "'");
}

// This rank's stages of `model`, `per_stage` modules each: stages rank, rank + p, ...
std::vector<torch::nn::Sequential> own_stages(const torch::nn::Sequential& model, int rank, int p,
                                              int v, int per_stage) {
  std::vector<torch::nn::Sequential> chunks;
  for (int k = rank; k < p * v; k += p) {
    chunks.push_back(
        slice(model, static_cast<size_t>(k * per_stage), static_cast<size_t>((k + 1) * per_stage)));
  }
  return chunks;
}

// The control's work (see run_pipeline_ranks_worker): the step's micro-batches, and for each
// micro-batch and stage of this rank a random input and a random output gradient.
struct ControlWork {
  std::vector<at::Tensor> xs, ys;
  std::vector<std::vector<at::Tensor>> ins, grads;
};

ControlWork draw_control_work(const at::Tensor& x, const at::Tensor& y, int m, size_t stages) {
  ControlWork w;
  w.xs = x.chunk(m);
  w.ys = y.chunk(m);
  // Drawn once, outside the timed region: the pipeline draws nothing.
  w.ins.resize(static_cast<size_t>(m));
  w.grads.resize(w.ins.size());
  for (size_t k = 0; k < w.ins.size(); ++k) {
    for (size_t c = 0; c < stages; ++c) {
      w.ins[k].push_back(at::randn_like(w.xs[k]));
      w.grads[k].push_back(at::randn_like(w.xs[k]));  // every layer keeps the width
    }
  }
  return w;
}

// The control itself: each stage's forward and backward of every micro-batch, without messages.
void compute_alone(std::vector<torch::nn::Sequential>& chunks, const ControlWork& w, bool first,
                   bool last) {
  for (size_t k = 0; k < w.ins.size(); ++k) {
    for (size_t c = 0; c < chunks.size(); ++c) {
      const bool first_stage = first && c == 0, last_stage = last && c + 1 == chunks.size();
      // (detach: a fresh leaf on the same storage, so no gradient accumulates on it)
      auto in = first_stage ? w.xs[k] : w.ins[k][c].detach().requires_grad_(true);
      auto out = chunks[c]->forward(in);
      if (last_stage) {
        mse(out, w.ys[k]).backward();
      } else {
        out.backward(w.grads[k][c]);
      }
    }
  }
  for (auto& c : chunks) c->zero_grad();
}

// Seconds of `f` on every rank, from a barrier to the next.
double seconds_between_barriers(const Dist& d, const std::function<void()>& f) {
  d.barrier();
  auto t0 = std::chrono::steady_clock::now();
  f();
  d.barrier();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int run_pipeline_ranks_worker(const std::vector<std::string>& args) {
  auto kv = parse_kv(args);
  const auto schedule = schedule_of(arg_or(kv, "--schedule", "1f1b"));
  const int64_t width = std::stoll(arg_or(kv, "--width", "512"));
  const int64_t batch = std::stoll(arg_or(kv, "--batch-size", "1024"));
  const int repeats = std::stoi(arg_or(kv, "--repeats", "5"));
  const bool quick = arg_or(kv, "--quick", "0") == "1";
  const bool shared_memory = arg_or(kv, "--shared-memory", "1") == "1";
  Dist d = init_process_group();
  at::set_num_threads(1);
  const int p = d.size();
  const int v = schedule == PipelineSchedule::kInterleaved1F1B ? 2 : 1;
  const int per_stage = 2 * kLayers / (p * v);
  auto x = at::randn({batch, width}, at::make_generator<at::CPUGeneratorImpl>(1));
  auto y = at::randn({batch, width}, at::make_generator<at::CPUGeneratorImpl>(2));
  std::ofstream csv;
  if (d.rank() == 0) csv.open(kv.at("--csv"));
  for (int m : microbatch_counts(quick)) {
    if (m % (v > 1 ? p : 1) != 0) continue;
    auto model = linear_tanh_stack(kLayers, width);
    auto chunks = own_stages(model, d.rank(), p, v, per_stage);
    DistPipelineOptions o;
    for (int r = 0; r < p; ++r) o.stage_ranks.push_back(r);
    o.chunks = m;
    o.schedule = schedule;
    o.shared_memory = shared_memory;
    DistPipeline pipe = v > 1 ? DistPipeline(chunks, o, d) : DistPipeline(chunks[0], o, d);
    const bool first = d.rank() == 0, last = d.rank() == p - 1;
    auto step = [&] {
      pipe.train_step(first ? x : at::Tensor(), last ? y : at::Tensor(), mse);
      for (auto& c : chunks) c->zero_grad();
    };
    // The control: each rank computes its own stages' forwards and backwards of the step's
    // micro-batches at the same moment as the other, with no message and no schedule (a stage
    // past the first takes a random input of the activation's shape and needs its gradient; a
    // stage before the last, a random output gradient). Timed beside each step, it is what this
    // machine gives two busy processes at once, drift included.
    const ControlWork work = draw_control_work(x, y, m, chunks.size());
    auto alone = [&] { compute_alone(chunks, work, first, last); };
    // The baseline, timed beside each step as well: the whole model as one stage in one process
    // (rank 0, while rank 1 waits at the barrier), with the step's micro-batches. Beside the
    // step, the machine's drift during the run drops out of the figures against the theory.
    std::optional<Pipeline> whole;
    if (first) {
      PipelineOptions one;
      one.balance = {2 * kLayers};
      one.devices = {at::kCPU};
      one.chunks = m;
      whole.emplace(linear_tanh_stack(kLayers, width), one);
    }
    auto baseline = [&] {
      if (!whole) return;
      whole->train_step(x, y, mse);
      for (auto s : whole->stages()) s->zero_grad();
    };
    step();  // warm-up
    alone();
    baseline();
    for (int r = 0; r < repeats; ++r) {
      const double s = seconds_between_barriers(d, step);
      const double control = seconds_between_barriers(d, alone);
      const double one = seconds_between_barriers(d, baseline);
      if (d.rank() == 0) csv << m << "," << s << "," << control << "," << one << "\n";
    }
  }
  return 0;
}

namespace {

// One schedule's step times and their controls' (the same work on both ranks at once, without
// messages) by micro-batch count, from 2 worker processes.
struct StepTimes {
  std::map<int, std::vector<double>> step, control, one_stage;
};
StepTimes pipeline_ranks_times(const SuiteOptions& o, const std::string& schedule, bool shm,
                               int64_t width, int64_t batch) {
  const std::string what = "pipeline_ranks_" + schedule + (shm ? "" : "_gloo");
  const std::string csv = o.work_dir + "/" + what + ".csv";
  run_local_ranks(o, 2,
                  {o.self_exe, "bench-worker", "pipeline-ranks", "--csv", csv, "--schedule",
                   schedule, "--width", std::to_string(width), "--batch-size",
                   std::to_string(batch), "--repeats", std::to_string(o.repeats), "--quick",
                   o.quick ? "1" : "0", "--shared-memory", shm ? "1" : "0"},
                  what);
  StepTimes times;
  std::ifstream in(csv);
  std::string line;
  while (std::getline(in, line)) {
    const auto a = line.find(','), b = line.find(',', a + 1), c = line.find(',', b + 1);
    const int m = std::stoi(line.substr(0, a));
    times.step[m].push_back(std::stod(line.substr(a + 1, b - a - 1)));
    times.control[m].push_back(std::stod(line.substr(b + 1, c - b - 1)));
    times.one_stage[m].push_back(std::stod(line.substr(c + 1)));
  }
  return times;
}

// The mean of f(0), ..., f(n - 1).
double mean_over(size_t n, const std::function<double(size_t)>& f) {
  double sum = 0;
  for (size_t k = 0; k < n; ++k) sum += f(k);
  return n > 0 ? sum / static_cast<double>(n) : 0;
}

std::string cell(double v) {
  char out[32];
  std::snprintf(out, sizeof out, "%.2f ", v);
  return out;
}

// The suite's notes: the model, the method and the table.
void add_notes(SuiteResult& r, int64_t width, int64_t batch, const std::string& table) {
  r.notes.push_back("Model: " + std::to_string(2 * kLayers) + " Linear+Tanh layers of width " +
                    std::to_string(width) + ", batch " + std::to_string(batch) +
                    ", MSE loss, 2 processes with one intra-op thread each (interleaved: 4 "
                    "stages, 2 per rank), activations and gradients through shared memory "
                    "(rows \"over Gloo\": loopback TCP). "
                    "Baseline: the same model as one stage in one process with the same "
                    "micro-batches, timed beside each step (rank 0 alone, rank 1 waiting), so "
                    "the machine's drift during the run drops out. Measured bubble = 1 - "
                    "T_one_stage / (2 T_step) per repetition; theory as in pipeline-bubble. The "
                    "control, timed beside each "
                    "step in the same processes: each rank computes its own stages' forwards and "
                    "backwards of the step's micro-batches at the same moment as the other, "
                    "without messages or schedule; against it the ideal step is T_control / (1 - "
                    "bubble), so what the machine loses to two busy processes at once (shared "
                    "caches, memory bandwidth, a neighbour's load) and its drift during the run "
                    "drop out, and what remains is the pipeline's own cost.");
  r.notes.push_back(
      "Each schedule's step time against its theory's (T_one_stage / p / (1 - bubble); 1.00 = "
      "the theory reached) and against the control's (T_control / (1 - bubble)), repetition by "
      "repetition, mean of the repetitions:\n\n" +
      table);
}

}  // namespace

SuiteResult run_pipeline_ranks(const SuiteOptions& o) {
  const std::string title =
      "Pipeline bubble across 2 processes: measured vs each schedule's theory";
  SuiteResult r =
      new_result("pipeline-ranks", title, "fraction",
                 {Plot::Kind::kLines, title, "micro-batches m", "bubble fraction", true, false}, o);
  const int p = 2;
  const int64_t width = o.quick ? 256 : 512, batch = o.quick ? 512 : 1024;
  const auto ms = microbatch_counts(o.quick);
  struct Sched {
    std::string flag, name;
    int per_rank;
    std::function<double(int)> theory;
  };
  const std::vector<Sched> scheds = {
      {"gpipe", "GPipe", 1, [&](int m) { return bubble_fraction(p, m); }},
      {"1f1b", "1F1B", 1, [&](int m) { return bubble_fraction(p, m); }},
      {"interleaved", "interleaved 1F1B (v=2)", 2,
       [&](int m) { return interleaved_bubble_fraction(p, 2, m); }},
      {"zb-h1", "zero bubble H1", 1, [&](int m) { return zero_bubble_h1_bubble_fraction(p, m); }},
  };
  std::string table = "| schedule | theory / measured step time at m = ";
  for (size_t k = 0; k < ms.size(); ++k) table += (k ? ", " : "") + std::to_string(ms[k]);
  table += " | the same against the control |\n|---|---|---|\n";
  // With --full, each schedule through Gloo too (the plot shows the shared-memory runs).
  const std::vector<bool> paths =
      o.quick ? std::vector<bool>{true} : std::vector<bool>{true, false};
  std::string machine = "| the control itself: T_one_stage / p / T_control (GPipe's run) | ";
  for (const auto& sc : scheds) {
    for (const bool shm : paths) {
      const auto times = pipeline_ranks_times(o, sc.flag, shm, width, batch);
      std::string row = "| " + sc.name + (shm ? "" : " over Gloo") + " | ", against = "| ";
      for (int m : ms) {
        if (!times.step.count(m)) {
          row += "- ";
          against += "- ";
          continue;
        }
        const auto& steps = times.step.at(m);
        const auto& one = times.one_stage.at(m);
        const auto& control = times.control.at(m);
        const double keep = 1.0 - sc.theory(m);
        if (shm) {
          Sample s{sc.name + " measured", std::to_string(m), static_cast<double>(m), {}};
          for (size_t k = 0; k < steps.size(); ++k) {
            s.values.push_back(1.0 - one[k] / (p * steps[k]));
          }
          r.samples.push_back(s);
          r.samples.push_back(
              {"theory, " + sc.name, std::to_string(m), static_cast<double>(m), {sc.theory(m)}});
        }
        // Repetition by repetition: each baseline and control was timed beside its step.
        row +=
            cell(mean_over(steps.size(), [&](size_t k) { return one[k] / p / keep / steps[k]; }));
        against +=
            cell(mean_over(steps.size(), [&](size_t k) { return control[k] / keep / steps[k]; }));
        if (&sc == &scheds.front() && shm) {
          machine +=
              cell(mean_over(steps.size(), [&](size_t k) { return one[k] / p / control[k]; }));
        }
      }
      table += row + against + "|\n";
    }
  }
  table += machine + "| |\n";
  add_notes(r, width, batch, table);
  return r;
}

}  // namespace scaletrain::bench
