#pragma once
// Recording benchmark results: every repetition to CSV, statistics to JSON, a PNG plot (through
// gnuplot) and a Markdown section with the machine and the exact command. Used by
// `scaletrain bench`; free of LibTorch.

#include <string>
#include <vector>

namespace scaletrain::bench {

struct Stats {
  double mean = 0, std = 0, min = 0, max = 0;  // std: population standard deviation
  size_t n = 0;
};

/// Statistics of a non-empty list of values (an empty list gives n == 0 and zeros).
Stats stats(const std::vector<double>& values);

/// One measured configuration: a series (e.g. "pipelined"), a point on the x axis, and every
/// repetition measured there.
struct Sample {
  std::string series;
  std::string x;       // label, e.g. "model parallel" or "20"
  double x_value = 0;  // numeric x for line plots
  std::vector<double> values;
};

struct Plot {
  enum class Kind { kBars, kLines };
  Kind kind = Kind::kBars;
  std::string title, xlabel, ylabel;
  bool logx = false, logy = false;
};

struct Machine {
  std::string cpu;  // model name
  int cores = 0;
  std::string gpu;       // "none" without one
  std::string libtorch;  // LibTorch version
  std::string date;      // YYYY-MM-DD
};

struct SuiteResult {
  std::string suite;  // e.g. "allreduce"
  std::string title;
  std::string command;  // the exact command that reproduces it
  std::string unit;     // of the values, e.g. "s" or "GB/s"
  std::vector<Sample> samples;
  Plot plot;
  std::vector<std::string> notes;  // extra report lines (derived figures, caveats)
};

/// This machine: CPU model and cores from /proc and the system; gpu and libtorch as given.
Machine describe_machine(const std::string& gpu, const std::string& libtorch);

/// Writes DIR/<suite>.csv (series,x,repetition,value), DIR/<suite>.json (per sample: mean, std,
/// min, max, n), DIR/<suite>.png, and appends the Markdown section to DIR/report.md. Returns the
/// section. Throws Error when DIR cannot be written or gnuplot fails.
std::string write_suite(const SuiteResult& result, const Machine& machine, const std::string& dir);

/// Draws the plot to `png_path` with gnuplot: bars with std error bars, or lines with error bars.
void plot_png(const SuiteResult& result, const std::string& png_path);

}  // namespace scaletrain::bench
