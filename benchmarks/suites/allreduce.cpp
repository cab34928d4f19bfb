// Suite `allreduce`: message sizes from 4 KB up, over 2..N ranks on this host, through Gloo and
// through the shared-memory path DDP takes on one machine. Reports
// algorithm bandwidth (bytes / time) and bus bandwidth (algbw * 2(n-1)/n, what a ring moves per
// link, as nccl-tests define it) against the host's memory-copy bandwidth, the ceiling for ranks
// that share one memory.

#include <ATen/ATen.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "dist/collectives.h"  // the library's private interface: this suite measures it
#include "scaletrain/bench_suites.h"
#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "suites_internal.h"

namespace scaletrain::bench {
namespace {

int64_t max_bytes(bool quick) { return quick ? (16 << 20) : (256 << 20); }

double memcpy_gbps(int64_t bytes, int repeats) {
  auto src = at::rand({bytes / 4});
  auto dst = at::empty_like(src);
  dst.copy_(src);
  std::vector<double> gbps;
  for (int i = 0; i < repeats; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    dst.copy_(src);
    gbps.push_back(static_cast<double>(bytes) / seconds_since(t0) / 1e9);
  }
  return stats(gbps).mean;
}

}  // namespace

int run_allreduce_worker(const std::string& csv_path, bool quick, int repeats,
                         const std::string& only, int64_t one_size) {
  Dist d = init_process_group();
  std::ofstream csv;
  if (d.rank() == 0) csv.open(csv_path);
  // The path DDP takes (Note [Collectives]): one segment on one machine, hierarchical across
  // machines (Note [Hierarchical reduce]), 4 MB rounds.
  CollectivesOptions co;
  co.chunk_floats = int64_t{1} << 20;
  co.hierarchical = true;
  auto comm = make_collectives(d, co, "scaletrain/bench/allreduce");
  const bool hier = comm->path().rfind("hierarchical", 0) == 0;
  auto wanted = [&](const std::string& path) { return only.empty() || only == path; };
  const int64_t first = one_size > 0 ? one_size : 4 << 10;
  const int64_t last = one_size > 0 ? one_size : max_bytes(quick);
  for (int64_t bytes = first; bytes <= last; bytes *= 4) {
    std::vector<at::Tensor> t{at::ones({bytes / 4})};
    // One warm-up, then `repeats` timed all-reduces, each started together after a barrier.
    auto time = [&](const std::string& path, const std::function<void(const std::string&)>& op) {
      op("warm-up all-reduce");
      for (int i = 0; i < repeats; ++i) {
        d.barrier("barrier");
        auto t0 = std::chrono::steady_clock::now();
        op("all-reduce of " + std::to_string(bytes) + " bytes");
        if (d.rank() == 0) csv << bytes << "," << seconds_since(t0) << "," << path << "\n";
      }
    };
    if (wanted("gloo")) {
      time("gloo", [&](const std::string& what) { d.all_reduce(t[0], ReduceOp::SUM, what); });
    }
    if ((comm->shared_memory() && wanted("shm")) || (hier && wanted("hier"))) {
      time(hier ? "hier" : "shm",
           [&](const std::string& what) { comm->all_reduce_sum(t[0], what).wait(); });
    }
  }
  return 0;
}

SuiteResult run_allreduce(const SuiteOptions& o) {
  const std::string title = "All-reduce bus bandwidth (ranks on one host: Gloo, shared memory)";
  SuiteResult r = new_result(
      "allreduce", title, "GB/s",
      {Plot::Kind::kLines, title, "message size (bytes)", "bus bandwidth (GB/s)", true, false}, o);
  const int max_ranks =
      std::max(2, std::min(4, static_cast<int>(std::thread::hardware_concurrency())));
  for (int n = 2; n <= max_ranks; ++n) {
    std::string csv = o.work_dir + "/allreduce_" + std::to_string(n) + ".csv";
    std::vector<std::string> command = {
        o.self_exe,  "bench-worker",           "allreduce", "--csv", csv,
        "--repeats", std::to_string(o.repeats)};
    if (o.quick) command.push_back("--quick");
    run_local_ranks(o, n, command, "allreduce_" + std::to_string(n));
    std::ifstream in(csv);
    std::string line;
    std::vector<Sample> samples;
    while (std::getline(in, line)) {
      std::stringstream ls(line);
      std::string b, t, path;
      std::getline(ls, b, ',');
      std::getline(ls, t, ',');
      std::getline(ls, path, ',');
      double bytes = std::stod(b), secs = std::stod(t);
      const std::string series =
          std::to_string(n) + " ranks, " + (path == "shm" ? "shared memory" : "Gloo");
      if (samples.empty() || samples.back().x != b || samples.back().series != series) {
        samples.push_back({series, b, bytes, {}});
      }
      double algbw = bytes / secs / 1e9;
      samples.back().values.push_back(algbw * 2.0 * (n - 1) / n);
    }
    r.samples.insert(r.samples.end(), samples.begin(), samples.end());
  }
  double copy = memcpy_gbps(std::min<int64_t>(max_bytes(o.quick), 64 << 20), o.repeats);
  r.notes.push_back(
      "Memory-copy bandwidth of this host (one 64 MB tensor copy): " + std::to_string(copy) +
      " GB/s — the ceiling for ranks sharing its memory. "
      "Values are bus bandwidth: algbw × 2(n−1)/n.");
  return r;
}

}  // namespace scaletrain::bench
