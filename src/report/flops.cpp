#include "scaletrain/flops.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void check(const MatmulPeakOptions& o) {
  if (o.min_size < 1 || o.max_size < o.min_size || o.repeats < 1 || !(o.budget_s >= 0)) {
    throw UsageError("MatmulPeakOptions: sizes " + std::to_string(o.min_size) + ".." +
                     std::to_string(o.max_size) + ", repeats " + std::to_string(o.repeats) +
                     ", budget " + std::to_string(o.budget_s) +
                     " s: give 1 <= min_size <= max_size, repeats >= 1 and a budget >= 0");
  }
}

}  // namespace

double measure_cpu_matmul_peak(const MatmulPeakOptions& o) {
  check(o);
  const auto start = Clock::now();
  // Operands from a generator of its own: the default one is the training's random stream.
  // Regression (MatmulPeakDrewFromTheTrainingStream): measured after a resume had restored the
  // generators, the peak's draws moved a GPT's dropout masks off the straight run's.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  {
    auto a = at::randn({o.min_size, o.min_size}, gen, at::kFloat);
    (void)at::mm(a, a);  // warm-up: the threads woken, the GEMM's buffers allocated
  }
  double best = 0;
  for (int64_t n = o.min_size; n <= o.max_size; n *= 2) {
    auto a = at::randn({n, n}, gen, at::kFloat);
    auto b = at::randn({n, n}, gen, at::kFloat);
    auto c = at::empty({n, n}, at::kFloat);
    const double flops = 2.0 * std::pow(static_cast<double>(n), 3);
    for (int r = 0; r < o.repeats; ++r) {
      if (r > 0 && seconds_since(start) > o.budget_s) break;
      const auto t0 = Clock::now();
      at::mm_out(c, a, b);
      // The steady clock ticks in nanoseconds, and the smallest product takes microseconds.
      best = std::max(best, flops / std::max(seconds_since(t0), 1e-9));
    }
  }
  return best;
}

double model_flops_utilization(double achieved, double peak_per_device, int64_t devices) {
  if (!(achieved > 0) || !(peak_per_device > 0) || devices < 1) return 0;
  return achieved / (peak_per_device * static_cast<double>(devices));
}

std::string format_flops(double f) {
  if (!(f > 0)) return "0 FLOP/s";
  const char* prefixes[] = {"", "k", "M", "G", "T", "P"};
  int i = 0;
  while (i < 5 && f >= 1000) f /= 1000, ++i;
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.*f %sFLOP/s", f >= 100 ? 0 : f >= 10 ? 1 : 2, f, prefixes[i]);
  return buf;
}

}  // namespace scaletrain
