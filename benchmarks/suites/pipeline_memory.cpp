// Suite `pipeline-memory`: peak activation memory of GPipe vs 1F1B, with and without
// activation checkpointing, for one training step of the same pipeline. Memory is measured, not
// estimated: a counting allocator is put in front of LibTorch's CPU allocator for the run and
// records the peak of the bytes held by tensors above what was held when the step began (the
// weights and their gradients are allocated by a warm-up step first), over the process and per
// device: each allocation is counted against the thread that made it, and each device of the
// in-process pipeline computes on a thread of its own. (So a device is charged with what it
// produced: a stage's input, which a cpu-to-cpu hand-off does not copy, counts on the stage
// before it, and its input gradients on the stage after it.)
// Expectation: GPipe holds the activations of all m micro-batches at once, 1F1B about p of
// them (schedule.h's peak_in_flight), checkpointing only each stage's inputs. Zero bubble H1
// keeps every stage at up to p in flight (1F1B: p − s on stage s), so its sum over the devices is
// higher, and its fullest device — the first, which holds p under both — is what the paper's
// "1F1B's memory" is about.

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "counting_allocator.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/schedule.h"
#include "suites_internal.h"

namespace scaletrain::bench {

namespace {

struct CheckpointMode {
  PipelineCheckpoint checkpoint;
  const char* name;
};

std::string schedule_name(PipelineSchedule sched) {
  return sched == PipelineSchedule::kGPipe             ? "GPipe"
         : sched == PipelineSchedule::k1F1B            ? "1F1B"
         : sched == PipelineSchedule::kInterleaved1F1B ? "interleaved 1F1B (v=2)"
                                                       : "zero bubble H1";
}

// Two devices of 2 * `layers` modules each (interleaved: two stages of `layers` on each).
PipelineOptions memory_options(PipelineSchedule sched, PipelineCheckpoint checkpoint, int m,
                               int layers) {
  PipelineOptions po;
  if (sched == PipelineSchedule::kInterleaved1F1B) {
    po.balance = {layers, layers, layers, layers};
    po.stages_per_device = 2;
  } else {
    po.balance = {2 * layers, 2 * layers};
  }
  po.devices = {at::kCPU, at::kCPU};
  po.chunks = m;
  po.schedule = sched;
  po.checkpoint = checkpoint;
  return po;
}

// `plain` and `per_device` by schedule, each against 1F1B's.
std::string memory_table(std::map<std::string, double>& plain,
                         std::map<std::string, double>& per_device) {
  std::string table =
      "Without checkpointing, in all (both devices) and on the fullest device (the bytes its "
      "stage thread allocated and still held at its peak), against 1F1B:\n\n| schedule | in all, "
      "MiB | vs 1F1B | fullest device, MiB | vs 1F1B |\n|---|---|---|---|---|\n";
  char line[400];
  for (const auto& [series, total] : plain) {
    std::snprintf(line, sizeof line, "| %s | %.2f | %.2f | %.2f | %.2f |\n", series.c_str(), total,
                  total / plain["1F1B"], per_device[series],
                  per_device[series] / per_device["1F1B"]);
    table += line;
  }
  return table;
}

}  // namespace

SuiteResult run_pipeline_memory(const SuiteOptions& o) {
  const std::string title = "Peak activation memory of one step: GPipe vs 1F1B, checkpointing";
  SuiteResult r =
      new_result("pipeline-memory", title, "MiB",
                 {Plot::Kind::kBars, title, "", "peak activation MiB", false, false}, o);
  const int p = 2, m = 8, layers = 4;
  const int64_t width = o.quick ? 512 : 1024, batch = o.quick ? 512 : 1024;
  IntraOpThreads one_thread(1);
  CountingScope scope;
  CountingAllocator& counting = scope.counter();
  auto x = at::randn({batch, width}), y = at::randn({batch, width});
  auto mse = [](const at::Tensor& out, const at::Tensor& t) {
    return torch::nn::functional::mse_loss(out, t);
  };
  const CheckpointMode modes[] = {{PipelineCheckpoint::kNever, "no checkpointing"},
                                  {PipelineCheckpoint::kExceptLast, "except last"},
                                  {PipelineCheckpoint::kAlways, "always"}};
  double gpipe_plain = 0, one_f_plain = 0;
  std::map<std::string, double> plain, per_device;  // no checkpointing: in all, fullest device
  for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                     PipelineSchedule::kInterleaved1F1B, PipelineSchedule::kZeroBubbleH1}) {
    const std::string series = schedule_name(sched);
    for (const auto& mode : modes) {
      const PipelineOptions po = memory_options(sched, mode.checkpoint, m, layers);
      Pipeline pipe(linear_tanh_stack(2 * layers, width), po);
      pipe.train_step(x, y, mse);  // allocates the gradients
      Sample s{series, mode.name, 0, {}};
      std::vector<double> fullest;
      for (int rep = 0; rep < std::max(1, std::min(o.repeats, 3)); ++rep) {
        counting.reset_peak();
        const int64_t before = counting.live();
        pipe.train_step(x, y, mse);
        s.values.push_back(static_cast<double>(counting.peak() - before) / (1 << 20));
        fullest.push_back(static_cast<double>(counting.peak_of_fullest_thread()) / (1 << 20));
      }
      if (mode.checkpoint == PipelineCheckpoint::kNever) {
        per_device[series] = stats(fullest).mean;
        plain[series] = stats(s.values).mean;
        if (sched == PipelineSchedule::kGPipe) gpipe_plain = plain[series];
        if (sched == PipelineSchedule::k1F1B) one_f_plain = plain[series];
      }
      r.samples.push_back(s);
    }
  }
  const int gp = peak_in_flight(gpipe_schedule(p, m), 0);
  const int of = peak_in_flight(one_f_one_b_schedule(p, m), 0);
  char line[400];
  std::snprintf(line, sizeof line,
                "1F1B's peak is %.2fx GPipe's (%.1f vs %.1f MiB). The schedules hold at most %d "
                "(GPipe) and %d (1F1B) micro-batches in flight on the first stage, a ratio of "
                "%.2f.",
                one_f_plain / gpipe_plain, one_f_plain, gpipe_plain, gp, of,
                static_cast<double>(of) / gp);
  r.notes.push_back("p = " + std::to_string(p) + " stages of " + std::to_string(layers) +
                    " Linear+Tanh layers of width " + std::to_string(width) + ", batch " +
                    std::to_string(batch) + " in m = " + std::to_string(m) +
                    " micro-batches, on cpu,cpu. Peak bytes held by tensors during a step, "
                    "above those held before it, by a counting allocator.");
  r.notes.push_back(line);
  std::snprintf(line, sizeof line,
                "Without checkpointing: interleaved 1F1B (v=2) %.1f MiB (%.2fx 1F1B's; its "
                "first device holds %d stage-micro-batches of half a stage each), zero bubble "
                "H1 %.1f MiB (%.2fx 1F1B's; at most %d micro-batches from F to W on a stage, "
                "each layer's graph kept apart until W).",
                plain["interleaved 1F1B (v=2)"], plain["interleaved 1F1B (v=2)"] / one_f_plain,
                peak_in_flight(interleaved_schedule(p, 2, m), 0), plain["zero bubble H1"],
                plain["zero bubble H1"] / one_f_plain,
                peak_in_flight(zero_bubble_h1_schedule(p, m), 0));
  r.notes.push_back(line);
  r.notes.push_back(memory_table(plain, per_device));
  return r;
}

}  // namespace scaletrain::bench
