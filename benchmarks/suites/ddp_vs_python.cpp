// Suites `ddp-vs-python` and `ddp-overlap`.
//
// ddp-vs-python: the framework compared, not models: MLP, LeNet and the small-image ResNet-18
// on Fashion-MNIST, CPU, global batch 256, 1 and 2 processes with one thread each, the same
// model definition on both sides (the zoo's with model_optimizations off; the Python peer
// benchmarks/python/ddp_peer.py: DataLoader + DistributedSampler + gloo under torchrun, the same
// torch in the project's .venv), measured one after the other in the same run. Both time whole
// training steps (batch assembly, forward, backward, all-reduce, optimizer) between barriers.
// The zoo's model-level optimisations are measured apart, against the same model without them,
// and each side reports where its step's time goes.
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
#include "scaletrain/sampler.h"
#include "suites_internal.h"
#include "zoo_models.h"

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

}  // namespace

// Where a step's time goes, in seconds summed over the timed steps.
struct Phases {
  double data = 0, forward = 0, backward = 0, step = 0;
};

namespace {

using Clock = std::chrono::steady_clock;

// Seconds from `t` to now; `t` becomes now.
double lap(Clock::time_point& t) {
  auto now = Clock::now();
  double s = std::chrono::duration<double>(now - t).count();
  t = now;
  return s;
}

// Whole training steps, one at a time, over this rank's share of the sampler's epochs.
class DdpSteps {
 public:
  DdpSteps(const Dataset& data, DistributedSampler& sampler, int64_t per_rank, bool channels_last,
           Model& m, DistributedDataParallel& ddp, torch::optim::SGD& opt)
      : data_(data),
        sampler_(sampler),
        per_rank_(per_rank),
        channels_last_(channels_last),
        m_(m),
        ddp_(ddp),
        opt_(opt) {}

  // One step; with `ph`, adds where its time went.
  void operator()(Phases* ph) {
    auto t = Clock::now();
    if (pos_ + static_cast<size_t>(per_rank_) > idx_.size()) {
      sampler_.set_epoch(epoch_++);
      idx_ = sampler_.indices();
      pos_ = 0;
    }
    std::vector<int64_t> part(idx_.begin() + static_cast<long>(pos_),
                              idx_.begin() + static_cast<long>(pos_) + per_rank_);
    pos_ += static_cast<size_t>(per_rank_);
    auto [x, y] = gather_batch(data_, part);
    if (channels_last_) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    const double t_data = lap(t);
    auto loss =
        torch::nn::functional::cross_entropy(ddp_.forward([&] { return m_.forward(x); }), y);
    const double t_forward = lap(t);
    loss.backward();
    const double t_backward = lap(t);
    opt_.step();
    ddp_.zero_grad();
    if (ph != nullptr) {
      ph->data += t_data;
      ph->forward += t_forward;
      ph->backward += t_backward;
      ph->step += lap(t);
    }
  }

 private:
  const Dataset& data_;
  DistributedSampler& sampler_;
  const int64_t per_rank_;
  const bool channels_last_;
  Model& m_;
  DistributedDataParallel& ddp_;
  torch::optim::SGD& opt_;
  std::vector<int64_t> idx_;
  size_t pos_ = 0;
  int64_t epoch_ = 0;
};

// Rank 0's phases file: ms per step of each phase, and of backward without synchronisation.
void write_phases(const std::string& path, const Phases& synced, const Phases& local, int steps,
                  int repeats) {
  const double n = static_cast<double>(steps) * repeats;
  std::ofstream out(path);
  out << "data," << 1e3 * synced.data / n << "\nforward," << 1e3 * synced.forward / n
      << "\nbackward," << 1e3 * synced.backward / n << "\nstep," << 1e3 * synced.step / n
      << "\nbackward_local," << 1e3 * local.backward / steps << "\n";
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
  const std::string phases_csv = arg_or(kv, "--phases", "");
  ModelOptions mo;
  mo.model_optimizations = arg_or(kv, "--plain", "0") == "0";
  Dist d = init_process_group();
  at::set_num_threads(1);
  Dataset data = load_fashion_mnist(kFashionMnistDir, true);
  torch::manual_seed(0);
  Model m = make_model(model_name, mo);
  if (channels_last) to_channels_last(*m.module);  // as `scaletrain train` does by default
  DDPOptions opts;
  opts.overlap = overlap;
  opts.shared_memory = shared_memory;
  DistributedDataParallel ddp(m.module, d, opts);
  torch::optim::SGD opt(m.module->parameters(),
                        torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(5e-4));
  DistributedSampler sampler({data.size(), d.size(), d.rank(), true, 0, false});
  const int64_t per_rank = batch / d.size();
  DdpSteps step(data, sampler, per_rank, channels_last, m, ddp, opt);
  for (int i = 0; i < warmup; ++i) step(nullptr);
  std::ofstream csv;
  if (d.rank() == 0) csv.open(kv["--csv"], std::ios::app);
  Phases synced;
  for (int r = 0; r < repeats; ++r) {
    d.barrier("barrier");
    auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i) step(&synced);
    d.barrier("barrier");
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (d.rank() == 0) csv << static_cast<double>(steps * batch) / secs << "\n" << std::flush;
  }
  if (!phases_csv.empty()) {
    // The same steps without gradient synchronisation: backward alone, so that communication
    // (what DDP adds to backward) is the difference.
    Phases local;
    {
      auto no_sync = ddp.no_sync();
      for (int i = 0; i < steps; ++i) step(&local);
    }
    d.barrier("barrier");
    if (d.rank() == 0) write_phases(phases_csv, synced, local, steps, repeats);
  }
  return 0;
}

namespace {

std::map<std::string, double> read_phases(const std::string& csv) {
  std::map<std::string, double> out;
  std::ifstream in(csv);
  std::string line;
  while (std::getline(in, line)) {
    auto comma = line.find(',');
    if (comma != std::string::npos) out[line.substr(0, comma)] = std::stod(line.substr(comma + 1));
  }
  return out;
}

struct ModelRun {
  std::string name;
  int steps;
};

// By key (run_rounds): samples/s of every round; where the last round's time went.
using Runs = std::map<std::string, std::vector<double>>;
using PhaseTable = std::map<std::string, std::map<std::string, double>>;

// This machine's speed drifts by more than the differences measured: each repetition is a
// round of every configuration, launched afresh, alternating which side goes first, so drift
// hits both sides alike. Keys: "<side>/<model>/<n>", side "ours" (plain model, as the Python
// peer), "opt" (the zoo's model-level optimisations on), "py", "gloo" (ours, shared memory
// off). The last round also records where the time goes.
void run_rounds(const SuiteOptions& o, const PythonPeer& peer, const std::vector<ModelRun>& models,
                Runs& runs, PhaseTable& phases) {
  const std::string& python = peer.python;
  const std::string& script = peer.script;
  for (int round = 0; round < o.repeats; ++round) {
    const bool last = round + 1 == o.repeats;
    for (const auto& mr : models) {
      for (int n : {1, 2}) {
        const std::string steps = std::to_string(mr.steps);
        const std::string tag = mr.name + "_" + std::to_string(n) + "_" + std::to_string(round);
        auto record = [&](const std::string& side, std::vector<std::string> command) {
          const std::string name = side + "_" + tag;
          const std::string csv = o.work_dir + "/" + name + ".csv";
          const std::string phase_csv = o.work_dir + "/" + name + "_phases.csv";
          command.insert(command.end(), {"--csv", csv, "--model", mr.name, "--steps", steps,
                                         "--warmup", mr.name == "resnet18" ? "1" : "3", "--repeats",
                                         "1", "--channels-last", "1"});
          if (last) command.insert(command.end(), {"--phases", phase_csv});
          const std::string key = side + "/" + mr.name + "/" + std::to_string(n);
          for (double v : run_ranks(o, n, command, csv, name)) runs[key].push_back(v);
          if (last) phases[key] = read_phases(phase_csv);
        };
        auto ours = [&](const std::string& side, const std::string& plain, const std::string& shm) {
          record(side,
                 {o.self_exe, "bench-worker", "ddp", "--plain", plain, "--shared-memory", shm});
        };
        auto theirs = [&] { record("py", {python, script}); };
        if (round % 2 == 1) theirs();
        ours("ours", "1", "1");
        if (mr.name != "mlp") ours("opt", "0", "1");
        if (n == 2 && mr.name == "lenet") ours("gloo", "1", "0");
        if (round % 2 == 0) theirs();
      }
    }
  }
}

void add_samples(SuiteResult& r, const std::vector<ModelRun>& models, Runs& runs) {
  for (const auto& mr : models) {
    for (int n : {1, 2}) {
      const std::string label = mr.name + ", " + std::to_string(n) + (n == 1 ? " proc" : " procs");
      const std::string k = "/" + mr.name + "/" + std::to_string(n);
      r.samples.push_back({"scaletrain DDP (C++)", label, 0.0, runs["ours" + k]});
      r.samples.push_back({"PyTorch DDP (Python)", label, 0.0, runs["py" + k]});
      if (runs.count("opt" + k)) {
        r.samples.push_back({"scaletrain, model optimisations on", label, 0.0, runs["opt" + k]});
      }
    }
  }
  r.samples.push_back(
      {"scaletrain DDP (C++), Gloo only", "lenet, 2 procs", 0.0, runs["gloo/lenet/2"]});
}

// The framework comparison: the same model on both sides.
std::string framework_note(const std::vector<ModelRun>& models, Runs& runs) {
  auto mean = [&](const std::string& key) { return stats(runs[key]).mean; };
  std::string t =
      "**The framework, the same model on both sides** (samples/s, mean of the rounds; targets: "
      ">= 1.5x on mlp and lenet, >= 1.0x on resnet18, 1 -> 2 scaling >= 0.9 for lenet and "
      "resnet18):\n\n| model | processes | scaletrain | Python | scaletrain / Python | "
      "scaling 1 -> 2, scaletrain | scaling 1 -> 2, Python |\n|---|---|---|---|---|---|---|\n";
  for (const auto& mr : models) {
    for (int n : {1, 2}) {
      const std::string k = "/" + mr.name + "/" + std::to_string(n);
      const std::string k1 = "/" + mr.name + "/1", k2 = "/" + mr.name + "/2";
      const std::string scaling = n == 2
                                      ? fixed(mean("ours" + k2) / (2 * mean("ours" + k1))) + " | " +
                                            fixed(mean("py" + k2) / (2 * mean("py" + k1)))
                                      : std::string(" | ");
      t += "| " + mr.name + " | " + std::to_string(n) + " | " + fixed(mean("ours" + k), 0) + " | " +
           fixed(mean("py" + k), 0) + " | " + fixed(mean("ours" + k) / mean("py" + k)) + "x | " +
           scaling + " |\n";
    }
  }
  return t;
}

// The model-level optimisations, each against the same model without them.
std::string optimisations_note(const std::vector<ModelRun>& models, Runs& runs) {
  auto mean = [&](const std::string& key) { return stats(runs[key]).mean; };
  std::string t =
      "**Model-level optimisations** (scaletrain against itself, the same model without them: "
      "LeNet's input crop, fused relu + pool and stem-convolution gradient; ResNet-18's "
      "stem-convolution gradient). A Python user could write each of them too; they are not "
      "part of the framework ratio above.\n\n| model | processes | plain | optimised | gain |\n"
      "|---|---|---|---|---|\n";
  for (const auto& mr : models) {
    if (mr.name == "mlp") continue;
    for (int n : {1, 2}) {
      const std::string k = "/" + mr.name + "/" + std::to_string(n);
      t += "| " + mr.name + " | " + std::to_string(n) + " | " + fixed(mean("ours" + k), 0) + " | " +
           fixed(mean("opt" + k), 0) + " | " + fixed(mean("opt" + k) / mean("ours" + k)) + "x |\n";
    }
  }
  t += "\nShared memory's part at 2 processes (lenet, plain): " +
       fixed(mean("ours/lenet/2") / mean("gloo/lenet/2")) +
       "x against scaletrain over Gloo alone, which is " +
       fixed(mean("gloo/lenet/2") / mean("py/lenet/2")) + "x the Python peer.";
  return t;
}

// Where the time goes, per step at 2 processes.
std::string phases_note(const std::vector<ModelRun>& models, PhaseTable& phases) {
  std::string t =
      "**Where a step's time goes** at 2 processes (ms per step, rank 0, last round; "
      "communication = backward with DDP's synchronisation - backward under no_sync()):\n\n"
      "| model | side | data | forward | backward (compute) | communication | optimizer step "
      "| sum |\n|---|---|---|---|---|---|---|---|\n";
  for (const auto& mr : models) {
    for (const std::string side : {"ours", "py"}) {
      auto& ph = phases[side + "/" + mr.name + "/2"];
      const double comm = std::max(0.0, ph["backward"] - ph["backward_local"]);
      const double compute = ph["backward"] - comm;
      t += "| " + mr.name + " | " + (side == "ours" ? "scaletrain" : "Python") + " | " +
           fixed(ph["data"]) + " | " + fixed(ph["forward"]) + " | " + fixed(compute) + " | " +
           fixed(comm) + " | " + fixed(ph["step"]) + " | " +
           fixed(ph["data"] + ph["forward"] + ph["backward"] + ph["step"]) + " |\n";
    }
  }
  return t;
}

}  // namespace

SuiteResult run_ddp_vs_python(const SuiteOptions& o) {
  const std::string title =
      "DDP on CPU, the same models on both sides: scaletrain vs PyTorch's Python DDP";
  SuiteResult r = new_result(
      "ddp-vs-python", title, "samples/s",
      {Plot::Kind::kBars, title, "", "samples per second (global batch 256)", false, false}, o);
  const PythonPeer peer = python_peer(o, "ddp_peer.py");
  const std::vector<ModelRun> models = {
      {"mlp", o.quick ? 60 : 200}, {"lenet", o.quick ? 15 : 50}, {"resnet18", o.quick ? 2 : 5}};
  Runs runs;
  PhaseTable phases;
  run_rounds(o, peer, models, runs, phases);
  add_samples(r, models, runs);
  r.notes.push_back(framework_note(models, runs));
  r.notes.push_back(optimisations_note(models, runs));
  r.notes.push_back(phases_note(models, phases));
  r.notes.push_back(
      "Both sides: the same model definitions (scaletrain's zoo with model_optimizations off, "
      "benchmarks/python/ddp_peer.py), channels-last on both, one thread per process "
      "(OMP_NUM_THREADS=1), SGD with momentum and weight decay, Fashion-MNIST in memory, global "
      "batch 256, the Gloo process group, the same torch. scaletrain's DDP sums same-machine "
      "gradients through shared memory (its default); the Python peer is written as the seeds "
      "write it (DataLoader + DistributedSampler, DDP over Gloo) and started by scaletrain's "
      "launcher with torchrun's environment, as torchrun would start it.");
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
