// Suite `zero`: a ResNet-18 (11.2M parameters, 3-channel 32x32 images) trained with Adam by DDP
// and by ZeRO stages 1, 2 and 3 (ShardedDataParallel) on 1, 2 and 4 local ranks. Per rank: the
// bytes of parameters + gradients + optimizer state, counted from the live storages after a step,
// against the ZeRO paper's formulas (Ψ parameters, fp32: DDP 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2
// 4Ψ + 12Ψ/N, stage 3 16Ψ/N), the process's peak resident memory, and samples/s over the ranks.
// Both sides run the same model, data and optimizer; only the data-parallel wrapper differs.
// Stages "1m", "2m", "3m" add the mixed-precision policy (bf16 parameters and buffers over fp32
// master shards, fp32 reduction: Note [Mixed precision]) against its own formulas; their speed
// is compared with the same stage in fp32 (a change of precision, not a framework ratio).

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <fstream>
#include <sstream>

#include "scaletrain/bench_suites.h"
#include "scaletrain/ddp.h"
#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "scaletrain/zero.h"
#include "suites_internal.h"
#include "zoo_models.h"

namespace scaletrain::bench {
namespace {

const std::vector<std::string> kModes = {"ddp", "1", "2", "3", "1m", "2m", "3m"};
bool mixed(const std::string& m) { return m.back() == 'm'; }
std::string mode_name(const std::string& m) {
  if (m == "ddp") return "DDP";
  const std::string stage = m.substr(0, 1);
  return (stage == "3" ? "ZeRO-3 (fsdp)" : "ZeRO-" + stage) + (mixed(m) ? " bf16" : "");
}

// Bytes per rank of the ZeRO paper's formulas for Ψ fp32 parameters with Adam.
// Mixed: bf16 parameters (and stage 1's bf16 gradients), fp32 master, gradient and moments
// shards.
double formula(const std::string& mode, double psi, int n) {
  if (mode == "ddp") return 16 * psi;
  if (mode == "1m") return 4 * psi + 16 * psi / n;
  if (mode == "2m") return 2 * psi + 16 * psi / n;
  if (mode == "3m") return 16 * psi / n;
  if (mode == "1") return 8 * psi + 8 * psi / n;
  if (mode == "2") return 4 * psi + 12 * psi / n;
  return 16 * psi / n;
}

}  // namespace

int run_zero_worker(const std::vector<std::string>& args) {
  auto kv = parse_kv(args);
  const std::string mode = arg_or(kv, "--mode", "ddp");
  const int64_t batch = std::stoll(arg_or(kv, "--batch-size", "16"));
  const int steps = std::stoi(arg_or(kv, "--steps", "4"));
  const int warmup = std::stoi(arg_or(kv, "--warmup", "1"));
  const int repeats = std::stoi(arg_or(kv, "--repeats", "3"));
  Dist d = init_process_group();
  at::set_num_threads(1);
  torch::manual_seed(0);
  ModelOptions mo;
  mo.in_channels = 3;
  Model m = make_model("resnet18", mo);
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<ShardedDataParallel> zero;
  std::unique_ptr<torch::optim::Adam> opt;
  if (mode == "ddp") {
    ddp = std::make_unique<DistributedDataParallel>(m.module, d);
    opt = std::make_unique<torch::optim::Adam>(m.module->parameters(), 1e-3);
  } else {
    ShardOptions so;
    so.stage = std::stoi(mode);
    if (mixed(mode)) {
      so.param_dtype = so.buffer_dtype = at::kBFloat16;
      so.reduce_dtype = at::kFloat;
    }
    zero = so.stage == 3 ? std::make_unique<ShardedDataParallel>(as_sequential(m), d, so)
                         : std::make_unique<ShardedDataParallel>(m.module, d, so);
    opt = std::make_unique<torch::optim::Adam>(zero->parameters(), 1e-3);
  }
  auto x = at::randn({batch, 3, 32, 32});
  auto y = at::randint(10, {batch}, at::kLong);
  auto step = [&] {
    opt->zero_grad();
    at::Tensor out;
    if (ddp) {
      out = ddp->forward([&] { return m.forward(x); });
    } else if (zero->options().stage == 3) {
      out = (*zero)(x);
    } else {
      out = zero->forward([&] { return m.forward(mixed(mode) ? x.to(at::kBFloat16) : x); });
    }
    torch::nn::functional::cross_entropy(out.to(at::kFloat), y).backward();
    if (ddp) {
      opt->step();
    } else {
      zero->step(*opt);
    }
  };
  for (int i = 0; i < warmup; ++i) step();
  std::ofstream csv;
  if (d.rank() == 0) csv.open(kv.at("--csv"));
  for (int r = 0; r < repeats; ++r) {
    d.barrier();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    d.barrier();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (d.rank() == 0) csv << "samples_per_s," << steps * batch * d.size() / s << "\n";
  }
  const auto mem = ddp ? model_state_memory(*m.module, opt.get()) : zero->memory(opt.get());
  if (d.rank() == 0) {
    csv << "model_state_bytes," << mem.total() << "\n"
        << "parameter_bytes," << mem.parameters << "\n"
        << "gradient_bytes," << mem.gradients << "\n"
        << "optimizer_bytes," << mem.optimizer << "\n"
        << "peak_rss_bytes," << peak_rss() << "\n"
        << "psi," << parameter_count(*m.module) << "\n";
  }
  return 0;
}

SuiteResult run_zero(const SuiteOptions& o) {
  const std::string title =
      "Model state per rank: DDP vs ZeRO stages (ResNet-18, Adam; fp32 and bf16 parameters)";
  SuiteResult r = new_result("zero", title, "MB",
                             {Plot::Kind::kLines, title, "ranks (N)",
                              "parameters + gradients + Adam state per rank (MB)", false, false},
                             o);
  const std::vector<int> worlds = o.quick ? std::vector<int>{1, 2} : std::vector<int>{1, 2, 4};
  std::map<std::pair<std::string, int>, std::map<std::string, std::vector<double>>> got;
  for (int n : worlds) {
    for (const auto& mode : kModes) {
      const std::string what = "zero_" + mode + "_" + std::to_string(n);
      const std::string csv = o.work_dir + "/" + what + ".csv";
      std::vector<std::string> command = {o.self_exe,
                                          "bench-worker",
                                          "zero",
                                          "--csv",
                                          csv,
                                          "--mode",
                                          mode,
                                          "--repeats",
                                          std::to_string(o.quick ? 1 : o.repeats)};
      if (o.quick) {
        command.insert(command.end(), {"--steps", "2", "--batch-size", "8"});
      }
      run_local_ranks(o, n, command, what);
      std::ifstream in(csv);
      std::string line;
      auto& values = got[{mode, n}];
      while (std::getline(in, line)) {
        const auto comma = line.find(',');
        values[line.substr(0, comma)].push_back(std::stod(line.substr(comma + 1)));
      }
      const double mb = values.at("model_state_bytes")[0] / (1 << 20);
      r.samples.push_back({mode_name(mode), std::to_string(n), static_cast<double>(n), {mb}});
    }
  }
  const double psi = got.begin()->second.at("psi")[0];
  std::ostringstream table;
  table << "Ψ = " << static_cast<int64_t>(psi)
        << " parameters. Per rank, measured (formula, difference); samples/s over all ranks "
           "(ratio to DDP at the same N); the process's peak resident memory:\n\n"
        << "| wrapper | N | model state MB | formula MB | diff | samples/s | vs DDP (bf16: vs "
           "fp32) | peak RSS "
           "MB |\n|---|---|---|---|---|---|---|---|\n";
  for (int n : worlds) {
    for (const auto& mode : kModes) {
      auto& v = got[{mode, n}];
      const double measured = v.at("model_state_bytes")[0];
      const double f = formula(mode, psi, n);  // bytes
      const double rate = stats(v.at("samples_per_s")).mean;
      // fp32 stages against DDP; bf16 ones against the same stage in fp32.
      const std::string base = mixed(mode) ? mode.substr(0, 1) : "ddp";
      const double base_rate = stats(got[{base, n}].at("samples_per_s")).mean;
      char row[256];
      std::snprintf(row, sizeof row, "| %s | %d | %.1f | %.1f | %+.1f%% | %.1f | %.2f%s | %.0f |\n",
                    mode_name(mode).c_str(), n, measured / (1 << 20), f / (1 << 20),
                    100 * (measured - f) / f, rate, rate / base_rate,
                    mixed(mode) ? " (vs fp32)" : "", v.at("peak_rss_bytes")[0] / (1 << 20));
      table << row;
    }
  }
  r.notes.push_back(table.str());
  r.notes.push_back(
      "Mixed precision: the paper's (K = 12: fp16 parameters and gradients, fp32 master weights "
      "and Adam moments) is DDP 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N. "
      "ShardedDataParallel with param_dtype = bf16 keeps the shards' gradient in fp32 (4Ψ/N where "
      "the paper keeps 2Ψ/N, which its optimizer converts): stage 1 4Ψ + 16Ψ/N, stage 2 "
      "2Ψ + 16Ψ/N, stage 3 16Ψ/N (Note [Mixed precision] in src/zero/sharded.cpp). Their "
      "samples/s are compared with the same stage in fp32: bf16 compute is a change of precision, "
      "not of framework.");
  return r;
}

}  // namespace scaletrain::bench
