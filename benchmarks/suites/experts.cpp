// Suite `experts`: one mixture-of-experts layer (expert_parallel.h) on CPU processes, scaletrain
// against PyTorch's Python path on the same layer (benchmarks/python/moe_peer.py: the dispatch
// written with torch.distributed's all-to-alls as TorchTitan's AllToAllTokenDispatcher writes
// it), at ep 1 on one process and ep 2 on two. The weights and tokens are the same functions of
// their indices on both sides (moe_peer.py's ramp()), so both compute the same loss, which the
// report shows side by side. Each timed step: one forward and backward of the layer on each
// rank's tokens, between barriers (the slowest rank's time).
// Expectation: the experts' products are the same ATen calls on both sides; scaletrain's
// dispatch regroups with one index_select and its counts exchange is one call, where the Python
// peer's builds its permutation from Python integers: the C++ side should be at least as fast,
// the more so the smaller the layer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "scaletrain/expert_parallel.h"
#include "suites_internal.h"

namespace scaletrain::bench {
namespace {

struct MoeSize {
  int64_t dim = 256, hidden = 512, experts = 8, top_k = 2, tokens = 2048;
  int steps = 10, warmup = 2;
};

MoeSize moe_size(bool quick) {
  MoeSize s;
  if (quick) {
    s.dim = 64;
    s.hidden = 128;
    s.tokens = 512;
    s.steps = 4;
  }
  return s;
}

std::vector<std::string> moe_args(const MoeSize& s) {
  return {"--dim",     std::to_string(s.dim),     "--hidden", std::to_string(s.hidden),
          "--experts", std::to_string(s.experts), "--top-k",  std::to_string(s.top_k),
          "--tokens",  std::to_string(s.tokens),  "--steps",  std::to_string(s.steps),
          "--warmup",  std::to_string(s.warmup)};
}

// moe_peer.py's ramp(): sin(i · a + b) · scale over the flattened indices, in float64, then
// float32.
at::Tensor ramp(std::vector<int64_t> shape, double a, double b, double scale) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return (at::arange(n, at::kDouble) * a + b).sin().mul(scale).to(at::kFloat).reshape(shape);
}

std::string scientific(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6e", v);
  return buf;
}

struct MoeLaunch {
  double tokens_per_s = 0, loss = 0;
};

MoeLaunch read_moe_launch(const std::string& path, int64_t tokens) {
  std::ifstream in(path);
  if (!in) throw Error("experts: no results in " + path + " (the run wrote none)");
  std::vector<double> steps;
  MoeLaunch l;
  for (std::string line; std::getline(in, line);) {
    const auto comma = line.find(',');
    if (comma == std::string::npos) continue;
    const std::string key = line.substr(0, comma);
    const double v = std::stod(line.substr(comma + 1));
    if (key == "step") steps.push_back(v);
    if (key == "loss") l.loss = v;
  }
  if (steps.empty()) throw Error("experts: no timed steps in " + path);
  std::sort(steps.begin(), steps.end());
  l.tokens_per_s = static_cast<double>(tokens) / steps[steps.size() / 2];
  return l;
}

}  // namespace

int run_experts_worker(const std::vector<std::string>& args) {
  auto kv = parse_kv(args);
  MoeSize s;
  s.dim = std::stoll(arg_or(kv, "--dim", "256"));
  s.hidden = std::stoll(arg_or(kv, "--hidden", "512"));
  s.experts = std::stoll(arg_or(kv, "--experts", "8"));
  s.top_k = std::stoll(arg_or(kv, "--top-k", "2"));
  s.tokens = std::stoll(arg_or(kv, "--tokens", "2048"));
  s.steps = std::stoi(arg_or(kv, "--steps", "10"));
  s.warmup = std::stoi(arg_or(kv, "--warmup", "2"));
  Dist d = init_process_group();
  at::set_num_threads(1);
  MoEOptions mo(s.dim, s.hidden, s.experts);
  mo.top_k = s.top_k;
  MoE moe(mo);
  {
    torch::NoGradGuard no_grad;
    moe->router.copy_(ramp({s.experts, s.dim}, 0.37, 0.1, 0.5));
    moe->w1.copy_(ramp({s.experts, s.dim, s.hidden}, 0.11, 0.3, 1 / std::sqrt(double(s.dim))));
    moe->w2.copy_(ramp({s.experts, s.hidden, s.dim}, 0.07, 0.5, 1 / std::sqrt(double(s.hidden))));
  }
  if (d.size() > 1) moe->expert_parallel(&d);
  const at::Tensor x = ramp({s.tokens, s.dim}, 0.013, 1.0 + d.rank(), 1.0).requires_grad_();
  auto step = [&] {
    moe->zero_grad();
    x.mutable_grad() = at::Tensor();
    const at::Tensor loss = moe->forward(x).pow(2).mean();
    loss.backward();
    return loss.item<double>();
  };
  const double first = step();
  for (int i = 1; i < s.warmup; ++i) step();
  std::vector<double> times;
  for (int i = 0; i < s.steps; ++i) {
    d.barrier("experts step start");
    const auto t0 = std::chrono::steady_clock::now();
    step();
    d.barrier("experts step end");
    times.push_back(seconds_since(t0));
  }
  const auto losses = d.all_gather(at::full({1}, first, at::kDouble), "first losses");
  if (d.rank() == 0) {
    std::ofstream csv(arg_or(kv, "--csv", "experts.csv"));
    for (double t : times) csv << "step," << t << "\n";
    double sum = 0;
    for (const auto& l : losses) sum += l.item<double>();
    csv.precision(17);
    csv << "loss," << sum / static_cast<double>(losses.size()) << "\n";
    if (!csv) throw Error("experts worker: cannot write its CSV");
  }
  return 0;
}

SuiteResult run_experts(const SuiteOptions& o) {
  const std::string title = "A MoE layer on 1 and 2 CPU processes: scaletrain vs PyTorch's Python";
  SuiteResult r = new_result(
      "experts", title, "tokens/s",
      {Plot::Kind::kBars, title, "", "tokens per second (median step)", false, false}, o);
  const PythonPeer peer = python_peer(o, "moe_peer.py");
  const MoeSize s = moe_size(o.quick);
  std::map<std::string, std::vector<MoeLaunch>> runs;
  // Quick: two rounds (each side first once), the launches being most of the time.
  const int rounds = o.quick ? std::min(o.repeats, 2) : o.repeats;
  for (int round = 0; round < rounds; ++round) {
    for (int ranks : {1, 2}) {
      auto launch = [&](const std::string& side, std::vector<std::string> command) {
        const std::string name = side + "_ep" + std::to_string(ranks) + "_" + std::to_string(round);
        const std::string csv = o.work_dir + "/experts_" + name + ".csv";
        std::filesystem::remove(csv);
        const auto sizes = moe_args(s);
        command.insert(command.end(), sizes.begin(), sizes.end());
        command.insert(command.end(), {"--csv", csv});
        run_local_ranks(o, ranks, command, "experts_" + name);
        runs[side + " ep " + std::to_string(ranks)].push_back(
            read_moe_launch(csv, s.tokens * ranks));
      };
      auto python = [&] { launch("python", {peer.python, peer.script}); };
      if (round % 2 == 1) python();  // each side first in every other round
      launch("scaletrain", {o.self_exe, "bench-worker", "experts"});
      if (round % 2 == 0) python();
    }
  }
  std::map<std::string, double> mean;
  for (const auto& [key, launches] : runs) {
    Sample sample{"cpu", key + ": tokens/s", 0, {}};
    double sum = 0;
    for (const auto& l : launches) {
      sample.values.push_back(l.tokens_per_s);
      sum += l.tokens_per_s;
    }
    mean[key] = sum / static_cast<double>(launches.size());
    r.samples.push_back(sample);
  }
  r.notes.push_back("MoE layer: " + std::to_string(s.experts) + " experts (GELU MLPs " +
                    std::to_string(s.dim) + " -> " + std::to_string(s.hidden) + " -> " +
                    std::to_string(s.dim) + "), top " + std::to_string(s.top_k) + ", " +
                    std::to_string(s.tokens) +
                    " tokens per rank, fp32, one forward and backward per step, one intra-op "
                    "thread per process; ep 2: the experts spread over the 2 processes, tokens "
                    "by all-to-all (Gloo).");
  for (int ranks : {1, 2}) {
    const std::string k = " ep " + std::to_string(ranks);
    r.notes.push_back("ep " + std::to_string(ranks) + ": scaletrain " +
                      fixed(mean["scaletrain" + k] / mean["python" + k]) +
                      "x the Python peer's tokens/s (target at ep 2: 1.0x or more); the first "
                      "step's loss " +
                      scientific(runs["scaletrain" + k].front().loss) + " vs " +
                      scientific(runs["python" + k].front().loss) + ".");
  }
  r.notes.push_back("ep 2 on 2 processes against ep 1 on one: scaletrain " +
                    fixed(mean["scaletrain ep 2"] / mean["scaletrain ep 1"]) + "x, Python " +
                    fixed(mean["python ep 2"] / mean["python ep 1"]) + "x the tokens/s.");
  return r;
}

}  // namespace scaletrain::bench
