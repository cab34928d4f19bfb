#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>

#include "launch/net.h"
#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "scaletrain/launch.h"
#include "suites_internal.h"

namespace scaletrain::bench {

// The memory and context suites run ranks as threads of this process, each with its own Gloo
// process group. c10d's FlightRecorder is one per process, and concurrent records from several
// groups crash it (a tree insert during ProcessGroupGloo::enqueue: `bench context --full`
// segfaulted in its first barrier); real jobs have one group per process. Off here, before any
// group exists, as in the tests (tests/support/subprocess.cpp), unless asked for.
static const bool flight_recorder_off = [] {
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  return true;
}();

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

PythonPeer python_peer(const SuiteOptions& o, const std::string& script_name) {
  namespace fs = std::filesystem;
  const char* src_env = std::getenv("SCALETRAIN_SOURCE_DIR");
  const std::string src =
      src_env ? src_env : fs::path(o.self_exe).parent_path().parent_path().string();
  const char* py_env = std::getenv("SCALETRAIN_PYTHON");
  PythonPeer peer{py_env ? py_env : src + "/.venv/bin/python",
                  src + "/benchmarks/python/" + script_name};
  if (!fs::exists(peer.python) || !fs::exists(peer.script)) {
    throw Error("the Python peer needs " + peer.python + " and " + peer.script +
                " (run from a build folder inside the source tree, or set SCALETRAIN_PYTHON and "
                "SCALETRAIN_SOURCE_DIR)");
  }
  return peer;
}

void run_thread_ranks(int n, const std::function<void(int rank, Dist& d)>& body) {
  const int fd = net::bind_tcp(0, /*loopback_only=*/true, /*listen=*/false);
  const int port = net::bound_port(fd);
  ::close(fd);
  std::mutex mu;
  std::exception_ptr error;
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      try {
        InitOptions o;
        World w;
        w.rank = w.local_rank = r;
        w.world_size = w.local_world_size = n;
        w.master_port = port;
        o.world = w;
        o.backend = "gloo";
        Dist d = init_process_group(o);
        body(r, d);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& t : ranks) t.join();
  if (error) std::rethrow_exception(error);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int64_t peak_rss() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
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
      {"transformer",
       "GPT (4 layers, 256 wide) on 2 CPU processes: tokens/s and peak RSS per rank, scaletrain "
       "vs PyTorch's Python path side by side: DDP, tensor parallel 2, tensor + sequence "
       "parallel 2",
       run_transformer},
      {"llama",
       "Llama (GQA, SwiGLU, RMSNorm, rotary) on 2 and 4 CPU processes: tokens/s and peak RSS "
       "per rank, scaletrain vs PyTorch's Python path on the same model: DDP, tensor parallel, "
       "sequence parallel, FSDP2, FSDP x TP, pipeline x TP",
       run_llama},
      {"checkpoint",
       "a 123M-parameter model with Adam: what a checkpoint costs the step loop, "
       "synchronous save vs background save (AsyncCheckpointer), one file vs a DCP folder",
       run_checkpoint},
      {"transformer-memory",
       "GPT activation memory per rank, measured: one rank, tensor parallel 2, with sequence "
       "parallelism, with each block recomputed",
       run_transformer_memory},
      {"context",
       "GPT at a long context on CPU ranks: activation memory per rank and tokens/s at cp 1, "
       "2 (balanced and in order) and 4, ring attention",
       run_context},
      {"experts",
       "a mixture-of-experts layer on 1 and 2 CPU processes: tokens/s at ep 1 and ep 2, "
       "scaletrain vs PyTorch's Python path (all-to-all dispatch as TorchTitan writes it)",
       run_experts},
      {"resilience",
       "one worker SIGKILLed mid-training: time lost by fault-tolerant replicas (healed from a "
       "peer) vs ddp restarted from its checkpoint, and the replicas' times to re-form",
       run_resilience},
  };
  return all;
}

}  // namespace scaletrain::bench
