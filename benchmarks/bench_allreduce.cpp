// All-reduce bandwidth over the process group, as nccl-tests report it:
//   algbw = bytes / time,  busbw = algbw * 2 (n - 1) / n  (what a ring moves per link)
// against this machine's own memory-copy bandwidth (the ceiling for ranks on one host).
//
//   scaletrain run --nproc-per-node 2 -- build/benchmarks/bench_allreduce [--min-bytes 4096]
//       [--max-bytes 268435456] [--iters 20] [--warmup 3] [--csv FILE]
// Rank 0 prints one row per message size: mean and std over the iterations.

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string>

#include "scaletrain/dist.h"

namespace {

struct Args {
  int64_t min_bytes = 4 << 10;
  int64_t max_bytes = 256 << 20;
  int iters = 20;
  int warmup = 3;
  std::string csv;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    std::string v = argv[i + 1];
    if (k == "--min-bytes") a.min_bytes = std::stoll(v);
    else if (k == "--max-bytes") a.max_bytes = std::stoll(v);
    else if (k == "--iters") a.iters = std::stoi(v);
    else if (k == "--warmup") a.warmup = std::stoi(v);
    else if (k == "--csv") a.csv = v;
    else throw std::invalid_argument("unknown option " + k);
  }
  return a;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Bandwidth of one large tensor copy on this host, bytes/s (read + write counted once, as a
// memcpy benchmark does).
double memcpy_bandwidth(int64_t bytes) {
  auto src = at::rand({bytes / 4});
  auto dst = at::empty_like(src);
  dst.copy_(src);
  auto t0 = std::chrono::steady_clock::now();
  const int reps = 5;
  for (int i = 0; i < reps; ++i) dst.copy_(src);
  return static_cast<double>(bytes) * reps / seconds_since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  scaletrain::Dist d = scaletrain::init_process_group();
  const int n = d.size();
  std::ofstream csv;
  if (d.rank() == 0) {
    double copy_bw = memcpy_bandwidth(std::min<int64_t>(a.max_bytes, 256 << 20));
    std::cout << "all-reduce over " << n << " ranks (" << d.backend_name
              << "); memory-copy bandwidth of this host: " << std::fixed << std::setprecision(2)
              << copy_bw / 1e9 << " GB/s\n"
              << std::setw(12) << "bytes" << std::setw(12) << "time_us" << std::setw(10) << "std_us"
              << std::setw(12) << "algbw_GB/s" << std::setw(12) << "busbw_GB/s" << "\n";
    if (!a.csv.empty()) {
      csv.open(a.csv);
      csv << "ranks,bytes,mean_s,std_s,min_s,algbw_GBps,busbw_GBps,memcpy_GBps\n";
    }
    csv << std::setprecision(9);
    // copy_bw is repeated on every row so that each row stands alone.
    setenv("SCALETRAIN_MEMCPY_GBPS", std::to_string(copy_bw / 1e9).c_str(), 1);
  }
  for (int64_t bytes = a.min_bytes; bytes <= a.max_bytes; bytes *= 4) {
    std::vector<at::Tensor> t{at::ones({bytes / 4})};
    for (int i = 0; i < a.warmup; ++i) scaletrain::wait_for(d.backend->allreduce(t), "all-reduce", d);
    std::vector<double> times;
    for (int i = 0; i < a.iters; ++i) {
      scaletrain::wait_for(d.backend->barrier(), "barrier", d);
      auto t0 = std::chrono::steady_clock::now();
      scaletrain::wait_for(d.backend->allreduce(t), "all-reduce", d);
      times.push_back(seconds_since(t0));
    }
    if (d.rank() != 0) continue;
    double mean = 0, var = 0, mn = times[0];
    for (double x : times) mean += x, mn = std::min(mn, x);
    mean /= static_cast<double>(times.size());
    for (double x : times) var += (x - mean) * (x - mean);
    double std_dev = std::sqrt(var / static_cast<double>(times.size()));
    double algbw = static_cast<double>(bytes) / mean / 1e9;
    double busbw = algbw * 2.0 * (n - 1) / n;
    std::cout << std::setw(12) << bytes << std::setw(12) << std::setprecision(1) << mean * 1e6
              << std::setw(10) << std_dev * 1e6 << std::setw(12) << std::setprecision(3) << algbw
              << std::setw(12) << busbw << "\n";
    if (csv.is_open()) {
      csv << n << "," << bytes << "," << mean << "," << std_dev << "," << mn << "," << algbw << ","
          << busbw << "," << std::getenv("SCALETRAIN_MEMCPY_GBPS") << "\n";
    }
  }
  return 0;
}
