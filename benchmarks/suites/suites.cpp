#include <cstdlib>

#include "scaletrain/error.h"
#include "scaletrain/launch.h"
#include "suites_internal.h"

namespace scaletrain::bench {

SuiteResult new_result(const std::string& suite, const std::string& title, const std::string& unit,
                       const Plot& plot, const SuiteOptions& o) {
  SuiteResult r;
  r.suite = suite;
  r.title = title;
  r.unit = unit;
  r.plot = plot;
  r.command = "scaletrain bench " + suite + (o.quick ? " --quick" : "");
  return r;
}

void run_local_ranks(const SuiteOptions& o, int n, std::vector<std::string> command,
                     const std::string& what) {
  LaunchOptions lo;
  lo.command = std::move(command);
  lo.nproc_per_node = n;
  lo.master_port = 0;
  lo.quiet = true;
  lo.log_dir = o.work_dir + "/" + what + "_logs";
  setenv("OMP_NUM_THREADS", "1", 1);
  validate(lo);
  if (launch(lo) != 0) {
    throw Error("benchmark run '" + what + "' failed; its logs are in " + lo.log_dir);
  }
}

std::map<std::string, std::string> parse_kv(const std::vector<std::string>& args) {
  std::map<std::string, std::string> kv;
  for (size_t i = 0; i + 1 < args.size(); i += 2) kv[args[i]] = args[i + 1];
  return kv;
}

std::string arg_or(const std::map<std::string, std::string>& kv, const std::string& key,
                   const std::string& fallback) {
  auto it = kv.find(key);
  return it == kv.end() ? fallback : it->second;
}

const std::vector<Suite>& suites() {
  static const std::vector<Suite> all = {
      {"mp-vs-single",
       "seed 000: ResNet-50 on one device vs split over two vs pipelined, random data",
       run_mp_vs_single},
      {"split-sweep", "seed 000: pipelined ResNet-50, time per run over split sizes",
       run_split_sweep},
      {"dp-scaling",
       "seed 003: ResNet-18 on Fashion-MNIST, seconds per epoch and accuracy on 1..N devices, "
       "DDP and DataParallel",
       run_dp_scaling},
      {"async",
       "seed 004: synchronised vs unsynchronised timing, all devices at once, "
       "device-to-host copies with and without non_blocking",
       run_async},
      {"allreduce", "all-reduce bus bandwidth over 2..N ranks, 4 KB and up, vs memory copy",
       run_allreduce},
      {"ddp-vs-python",
       "MLP, LeNet, ResNet-18 on Fashion-MNIST, the same models on both sides: scaletrain DDP "
       "vs PyTorch's Python DDP, 1 and 2 processes; model-level gains apart; where time goes",
       run_ddp_vs_python},
      {"ddp-overlap",
       "small-image ResNet-18 on 2 processes: all-reduce overlapped with "
       "backward vs after it",
       run_ddp_overlap},
      {"pipeline-bubble",
       "GPipe, 1F1B, interleaved 1F1B, zero bubble H1 on cpu,cpu: measured bubble vs theory",
       run_pipeline_bubble},
      {"pipeline-ranks",
       "GPipe, 1F1B, interleaved 1F1B, zero bubble H1 across 2 processes (Gloo): measured "
       "bubble vs theory",
       run_pipeline_ranks},
      {"pipeline-memory",
       "peak activation memory of one pipelined step: GPipe, 1F1B, interleaved, zero bubble; "
       "activation checkpointing",
       run_pipeline_memory},
      {"stem-conv",
       "stem convolution weight gradient: LibTorch vs the batched product, sliced and not, "
       "time and peak bytes",
       run_stem_conv},
      {"loader", "Fashion-MNIST loader vs LeNet training throughput (target: loader >= 5x)",
       run_loader},
      {"zero",
       "ResNet-18 with Adam: model-state memory per rank and samples/s, DDP vs ZeRO stages 1, "
       "2, 3 on 1, 2, 4 ranks, against the ZeRO paper's formulas",
       run_zero},
  };
  return all;
}

}  // namespace scaletrain::bench
