// Suites `ddp-vs-python` and `ddp-overlap`.
//
// ddp-vs-python: LeNet on Fashion-MNIST, CPU, global batch 256, 1 and 2 processes with one
// thread each: scaletrain's DDP against PyTorch's Python DDP (benchmarks/python/ddp_lenet.py,
// DataLoader + DistributedSampler + gloo under torchrun, the same torch in the project's .venv),
// measured one after the other in the same run. Both time whole training steps (batch
// assembly, forward, backward, all-reduce, optimizer) between barriers.
//
// ddp-overlap: the small-image ResNet-18 on 2 processes, all-reduce overlapped with backward
// (buckets launched as they fill) against all-reduce after backward.

#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>

#include "scaletrain/data.h"
#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/models.h"
#include "scaletrain/sampler.h"
#include "suites_internal.h"

namespace scaletrain::bench {
namespace {

namespace fs = std::filesystem;

std::vector<double> read_values(const std::string& csv) {
  std::vector<double> v;
  std::ifstream in(csv);
  double x;
  while (in >> x) v.push_back(x);
  return v;
}

// Runs `command` as `n` ranks; returns rank 0's CSV values.
std::vector<double> run_ranks(const SuiteOptions& o, int n, std::vector<std::string> command,
                              const std::string& csv, const std::string& what) {
  fs::remove(csv);
  run_local_ranks(o, n, std::move(command), what);
  return read_values(csv);
}

// The project's Python and peer script, found from the binary's place (build/scaletrain) or
// SCALETRAIN_PYTHON / SCALETRAIN_SOURCE_DIR.
std::string source_dir(const SuiteOptions& o) {
  if (const char* s = std::getenv("SCALETRAIN_SOURCE_DIR")) return s;
  return fs::path(o.self_exe).parent_path().parent_path().string();
}

}  // namespace

int run_ddp_worker(const std::vector<std::string>& args) {
  auto kv = parse_kv(args);
  const std::string model_name = arg_or(kv, "--model", "lenet");
  const int64_t batch = std::stoll(arg_or(kv, "--batch-size", "256"));
  const int steps = std::stoi(arg_or(kv, "--steps", "40"));
  const int warmup = std::stoi(arg_or(kv, "--warmup", "5"));
  const int repeats = std::stoi(arg_or(kv, "--repeats", "5"));
  const bool overlap = arg_or(kv, "--overlap", "1") != "0";
  const bool channels_last = arg_or(kv, "--channels-last", "1") != "0";
  const bool shared_memory = arg_or(kv, "--shared-memory", "1") != "0";
  Dist d = init_process_group();
  at::set_num_threads(1);
  Dataset data = load_fashion_mnist(kFashionMnistDir, true);
  torch::manual_seed(0);
  Model m = make_model(model_name);
  if (channels_last) to_channels_last(*m.module);  // as `scaletrain train` does by default
  DDPOptions opts;
  opts.overlap = overlap;
  opts.shared_memory = shared_memory;
  DistributedDataParallel ddp(m.module, d, opts);
  torch::optim::SGD opt(m.module->parameters(),
                        torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(5e-4));
  DistributedSampler sampler({data.size(), d.size(), d.rank(), true, 0, false});
  const int64_t per_rank = batch / d.size();
  std::vector<int64_t> idx;
  size_t pos = 0;
  int64_t epoch = 0;
  auto step = [&] {
    if (pos + static_cast<size_t>(per_rank) > idx.size()) {
      sampler.set_epoch(epoch++);
      idx = sampler.indices();
      pos = 0;
    }
    std::vector<int64_t> part(idx.begin() + static_cast<long>(pos),
                              idx.begin() + static_cast<long>(pos) + per_rank);
    pos += static_cast<size_t>(per_rank);
    auto [x, y] = gather_batch(data, part);
    if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    auto out = ddp.forward([&] { return m.forward(x); });
    torch::nn::functional::cross_entropy(out, y).backward();
    opt.step();
    ddp.zero_grad();
  };
  for (int i = 0; i < warmup; ++i) step();
  std::ofstream csv;
  if (d.rank() == 0) csv.open(kv["--csv"], std::ios::app);
  for (int r = 0; r < repeats; ++r) {
    wait_for(d.backend->barrier(), "barrier", d);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    wait_for(d.backend->barrier(), "barrier", d);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (d.rank() == 0) csv << static_cast<double>(steps * batch) / secs << "\n" << std::flush;
  }
  return 0;
}

SuiteResult run_ddp_vs_python(const SuiteOptions& o) {
  const std::string title =
      "LeNet on Fashion-MNIST, DDP on CPU: scaletrain vs PyTorch's Python DDP";
  SuiteResult r = new_result(
      "ddp-vs-python", title, "samples/s",
      {Plot::Kind::kBars, title, "", "samples per second (global batch 256)", false, false}, o);
  const std::string src = source_dir(o);
  const char* py_env = std::getenv("SCALETRAIN_PYTHON");
  const std::string python = py_env ? py_env : src + "/.venv/bin/python";
  const std::string script = src + "/benchmarks/python/ddp_lenet.py";
  if (!fs::exists(python) || !fs::exists(script)) {
    throw Error("the Python peer needs " + python + " and " + script +
                " (run from a build folder inside the source tree, or set SCALETRAIN_PYTHON and "
                "SCALETRAIN_SOURCE_DIR)");
  }
  const std::string steps = o.quick ? "20" : "60";
  // This machine's speed drifts by more than the difference measured: each repetition is a
  // round of all four configurations, launched afresh, alternating which side goes first, so
  // drift hits both sides alike.
  std::map<std::string, std::vector<double>> runs;
  for (int round = 0; round < o.repeats; ++round) {
    for (int n : {1, 2}) {
      const std::string tag = std::to_string(n) + "_" + std::to_string(round);
      // `key`: "ours" (as `scaletrain train` runs) or "gloo" (shared memory off, as between
      // machines: what shared memory adds).
      auto ours = [&](const std::string& key) {
        const std::string name = "scaletrain_" + key + "_" + tag;
        const std::string csv = o.work_dir + "/" + name + ".csv";
        for (double v :
             run_ranks(o, n,
                       {o.self_exe, "bench-worker", "ddp", "--csv", csv, "--steps", steps,
                        "--repeats", "1", "--shared-memory", key == "ours" ? "1" : "0"},
                       csv, name)) {
          runs[key + std::to_string(n)].push_back(v);
        }
      };
      auto theirs = [&] {
        const std::string csv = o.work_dir + "/python_" + tag + ".csv";
        for (double v :
             run_ranks(o, n, {python, script, "--csv", csv, "--steps", steps, "--repeats", "1"},
                       csv, "python_" + tag)) {
          runs["py" + std::to_string(n)].push_back(v);
        }
      };
      if (round % 2 == 1) theirs();
      ours("ours");
      if (n == 2) ours("gloo");
      if (round % 2 == 0) theirs();
    }
  }
  std::map<std::string, double> mean;
  for (int n : {1, 2}) {
    const std::string label = std::to_string(n) + (n == 1 ? " process" : " processes");
    const std::string k = std::to_string(n);
    r.samples.push_back({"scaletrain DDP (C++)", label, static_cast<double>(n), runs["ours" + k]});
    r.samples.push_back({"PyTorch DDP (Python)", label, static_cast<double>(n), runs["py" + k]});
    mean["ours" + k] = stats(runs["ours" + k]).mean;
    mean["py" + k] = stats(runs["py" + k]).mean;
  }
  r.samples.push_back({"scaletrain DDP (C++), Gloo only", "2 processes", 2.0, runs["gloo2"]});
  mean["gloo2"] = stats(runs["gloo2"]).mean;
  char note[512];
  std::snprintf(note, sizeof(note),
                "scaletrain / Python at 2 processes: %.2fx (at 1 process: %.2fx). Scaling "
                "efficiency 1 -> 2 processes (throughput_2 / (2 x throughput_1)): scaletrain "
                "%.2f, Python %.2f. scaletrain over Gloo alone (no shared memory): %.2fx the "
                "Python peer, scaling %.2f.",
                mean["ours2"] / mean["py2"], mean["ours1"] / mean["py1"],
                mean["ours2"] / (2 * mean["ours1"]), mean["py2"] / (2 * mean["py1"]),
                mean["gloo2"] / mean["py2"], mean["gloo2"] / (2 * mean["ours1"]));
  r.notes.push_back(note);
  r.notes.push_back(
      "Both sides: one thread per process (OMP_NUM_THREADS=1), SGD with momentum, data in "
      "memory, the Gloo process group; scaletrain as `scaletrain train` runs it (channels-last "
      "convolutions; ranks on one machine sum gradients through shared memory, its default), "
      "the Python peer as the seeds write it (DDP's all-reduce over Gloo). The Python side is "
      "started by scaletrain's launcher with torchrun's environment, as torchrun would start "
      "it.");
  return r;
}

SuiteResult run_ddp_overlap(const SuiteOptions& o) {
  const std::string title =
      "Small-image ResNet-18, 2 processes: all-reduce overlapped with backward or after it";
  SuiteResult r = new_result("ddp-overlap", title, "samples/s",
                             {Plot::Kind::kBars, title, "", "samples per second", false, false}, o);
  const std::string steps = o.quick ? "3" : "10";
  const std::string batch = o.quick ? "16" : "64";
  struct Config {
    std::string tag, label, overlap, shared_memory;
  };
  // Overlap is a Gloo matter (sockets and worker threads to hide); through shared memory each
  // bucket is summed in its hook, on the training thread (Note [Shared-memory reduce]).
  const std::vector<Config> configs = {{"gloo_overlap", "Gloo, overlapped", "1", "0"},
                                       {"gloo_after", "Gloo, after backward", "0", "0"},
                                       {"shm", "shared memory (default)", "1", "1"}};
  std::map<std::string, double> mean;
  for (size_t i = 0; i < configs.size(); ++i) {
    const Config& c = configs[i];
    const std::string csv = o.work_dir + "/overlap_" + c.tag + ".csv";
    auto v = run_ranks(
        o, 2,
        {o.self_exe, "bench-worker", "ddp", "--model", "resnet18", "--csv", csv, "--steps", steps,
         "--warmup", "1", "--repeats", std::to_string(o.repeats), "--batch-size", batch,
         "--overlap", c.overlap, "--shared-memory", c.shared_memory},
        csv, "overlap_" + c.tag);
    r.samples.push_back({"resnet18", c.label, static_cast<double>(i), v});
    mean[c.tag] = stats(v).mean;
  }
  char note[320];
  std::snprintf(note, sizeof(note),
                "Over Gloo, overlap saves %.1f%% of the step time (%.1f vs %.1f samples/s, "
                "global batch %s); shared memory gives %.1f samples/s (%+.1f%% against Gloo "
                "overlapped).",
                100.0 * (1.0 - mean["gloo_after"] / mean["gloo_overlap"]), mean["gloo_overlap"],
                mean["gloo_after"], batch.c_str(), mean["shm"],
                100.0 * (mean["shm"] / mean["gloo_overlap"] - 1.0));
  r.notes.push_back(note);
  return r;
}

}  // namespace scaletrain::bench
