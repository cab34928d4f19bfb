#pragma once
// Model FLOPs utilisation (MFU): the FLOPs that a model's training needs per second, against the
// peak of the hardware it runs on. The trainer reports it (TrainResult::mfu) when the model
// states its FLOPs per sample (Model::flops_per_sample) and the peak is known: given
// (TrainerOptions::peak_flops), or on the CPU measured by measure_cpu_matmul_peak() below.
// docs/training.md, "Model FLOPs utilisation".

#include <cstdint>
#include <string>

namespace scaletrain {

struct MatmulPeakOptions {
  int64_t min_size = 512;   // square fp32 products of this size, doubling up to max_size
  int64_t max_size = 1024;  // (a size past max_size is not run)
  int repeats = 3;          // timed products per size; the fastest counts
  double budget_s = 0.25;   // no further repeat starts past this; each size still runs once
};

/// The CPU's fp32 matrix-product rate in FLOP/s (2·n³ per n×n product): the fastest of the
/// timed products of `options`, after one untimed warm-up. It runs on this process's intra-op
/// threads (at::get_num_threads(): a rank's own), so it is the peak that this process reaches
/// in LibTorch's GEMM, against which MFU on the CPU is measured. Blocks the calling thread for
/// a fraction of a second (about the budget, more on a slow or loaded machine). Returns a
/// positive, finite number. Throws UsageError for min_size < 1, max_size < min_size, repeats
/// < 1 or a negative budget.
double measure_cpu_matmul_peak(const MatmulPeakOptions& options = {});

/// achieved / (peak_per_device × devices): the fraction of the devices' peak that the model's
/// FLOPs reach. 0 when any of the three is 0 or less (unknown), never NaN.
double model_flops_utilization(double achieved_flops_per_second, double peak_flops_per_device,
                               int64_t devices);

/// A rate for people: "1.23 GFLOP/s", "45.6 MFLOP/s", "457 TFLOP/s" (three significant digits
/// under the largest of k, M, G, T, P that keeps the number at least 1; "0 FLOP/s" for 0 or
/// less).
std::string format_flops(double flops_per_second);

}  // namespace scaletrain
