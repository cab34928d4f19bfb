// Suite `stem-conv`: the weight gradient of a stem convolution, LibTorch's (oneDNN) against
// the batched product over the unfolded input (Note [Stem conv] in src/kernels/ops.cpp), sliced
// to stem_unfold_bytes() and unsliced: seconds and the peak resident memory one backward adds
// (the kernel's high-water mark, reset before it: /proc/self/clear_refs), on the
// one-channel stem the path is for (LeNet's) and on the 224x224 RGB stem it refuses (a 3x3
// convolution 3 -> 64 at batch 256 would unfold 1.4 GB at once).

#include <ATen/ops/randn.h>
#include <torch/nn/modules/conv.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "kernels/ops.h"
#include "suites_internal.h"
#include "zoo_models.h"

namespace scaletrain::bench {
namespace {

// The process's resident memory now and its high-water mark (VmRSS, VmHWM), in MiB.
double status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024;
  }
  return 0;
}

// Resets the high-water mark to the current resident size (Linux 4.0+).
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

}  // namespace

SuiteResult run_stem_conv(const SuiteOptions& o) {
  const std::string title = "Stem convolution weight gradient: LibTorch vs batched product";
  SuiteResult r =
      new_result("stem-conv", title, "s",
                 {Plot::Kind::kBars, title, "", "seconds per backward", false, true}, o);
  struct Shape {
    std::string name;
    int64_t in, out, batch, size;
  };
  const std::vector<Shape> shapes = {
      {"LeNet conv1 1->20, 28x28, batch 256", 1, 20, 256, 28},
      {"RGB stem 3->64, 224x224, batch " + std::string(o.quick ? "32" : "256"), 3, 64,
       o.quick ? 32 : 256, 224}};
  IntraOpThreads one_thread(1);  // as each rank trains (one thread per process)
  const int64_t budget = stem_unfold_bytes();
  std::string table =
      "Peak resident memory one backward adds (high-water mark after it minus resident size "
      "before it), MiB:\n\n"
      "| shape | LibTorch | path, sliced | path, unsliced |\n|---|---|---|---|\n";
  for (const auto& sh : shapes) {
    torch::nn::Conv2d conv(torch::nn::Conv2dOptions(sh.in, sh.out, 3).padding(1).bias(false));
    to_channels_last(*conv);
    auto x =
        at::randn({sh.batch, sh.in, sh.size, sh.size}).contiguous(at::MemoryFormat::ChannelsLast);
    std::string row = "| " + sh.name + " |";
    for (const std::string path : {"LibTorch", "path, sliced", "path, unsliced"}) {
      // The path's own function on any shape: the one-channel rule is conv2d's choice.
      set_stem_unfold_bytes(path == "path, unsliced" ? (int64_t{1} << 40) : budget);
      Sample s{path, sh.name, 0, {}};
      double peak = 0;
      for (int rep = 0; rep <= o.repeats; ++rep) {  // the first is a warm-up
        auto y = path == "LibTorch" ? conv->forward(x) : stem_conv2d(conv, x);
        auto g = at::ones_like(y);
        reset_peak_rss();
        const double before = status_mib("VmRSS");
        const auto t0 = std::chrono::steady_clock::now();
        y.backward(g);
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        peak = status_mib("VmHWM") - before;
        conv->zero_grad();
        if (rep > 0) s.values.push_back(secs);
      }
      char cell[32];
      std::snprintf(cell, sizeof cell, " %.0f |", peak);
      row += cell;
      r.samples.push_back(s);
    }
    table += row + "\n";
  }
  set_stem_unfold_bytes(budget);
  r.notes.push_back(table);
  r.notes.push_back(
      "Weight gradient only (the input needs none), channels-last, no bias, one intra-op "
      "thread. conv2d() takes the path for one-channel stems only; "
      "this suite calls the path's function directly on both shapes.");
  return r;
}

}  // namespace scaletrain::bench
