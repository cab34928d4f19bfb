#pragma once
// The suite functions behind bench::suites() (one file per suite in benchmarks/suites/).

#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "scaletrain/bench_suites.h"
#include "scaletrain/intra_op_threads.h"

namespace scaletrain {
struct Dist;
}  // namespace scaletrain

namespace scaletrain::bench {

/// `layers` pairs of Linear(width, width) + Tanh, seeded: the pipeline suites' model of equal
/// stages.
torch::nn::Sequential linear_tanh_stack(int layers, int64_t width);
/// pipeline-bubble's baseline: the best of `repeats` training steps (after a warm-up) of
/// linear_tanh_stack(layers, x.size(1)) as one stage on the CPU, in `m` micro-batches, MSE.
double one_stage_step_time(int layers, const at::Tensor& x, const at::Tensor& y, int m,
                           int repeats);

/// A result with its identity filled in; `command` is `scaletrain bench <suite>` (+ --quick).
SuiteResult new_result(const std::string& suite, const std::string& title, const std::string& unit,
                       const Plot& plot, const SuiteOptions& o);

/// Runs `command` as `n` local ranks (one thread each) through the launcher, quietly, with logs
/// under the work folder; throws Error naming the logs when a rank fails.
void run_local_ranks(const SuiteOptions& o, int n, std::vector<std::string> command,
                     const std::string& what);

/// The project's Python (.venv/bin/python) and a peer script of benchmarks/python/, found from
/// the binary's place (build/scaletrain-tool) or SCALETRAIN_PYTHON / SCALETRAIN_SOURCE_DIR.
/// Throws Error naming both when either is missing.
struct PythonPeer {
  std::string python, script;
};
PythonPeer python_peer(const SuiteOptions& o, const std::string& script_name);

/// Runs `body(rank, dist)` as `n` ranks on threads of this process, each with a Gloo process
/// group of its own over a free loopback port (the memory suites', whose counting allocator
/// tells the ranks apart by thread); rethrows a rank's error once every rank has ended.
void run_thread_ranks(int n, const std::function<void(int rank, Dist& d)>& body);

/// Seconds on the steady clock since `t0`.
double seconds_since(std::chrono::steady_clock::time_point t0);
/// This process's peak resident memory so far, in bytes (getrusage).
int64_t peak_rss();
/// `v` printed with `digits` digits after the point.
std::string fixed(double v, int digits = 2);

/// `--key value` pairs of a worker's arguments.
std::map<std::string, std::string> parse_kv(const std::vector<std::string>& args);
/// kv[key], or `fallback` when the worker was not given it.
std::string arg_or(const std::map<std::string, std::string>& kv, const std::string& key,
                   const std::string& fallback);

SuiteResult run_allreduce(const SuiteOptions& o);
SuiteResult run_zero(const SuiteOptions& o);
SuiteResult run_pipeline_ranks(const SuiteOptions& o);
SuiteResult run_async(const SuiteOptions& o);
SuiteResult run_ddp_vs_python(const SuiteOptions& o);
SuiteResult run_ddp_overlap(const SuiteOptions& o);
SuiteResult run_pipeline_bubble(const SuiteOptions& o);
SuiteResult run_loader(const SuiteOptions& o);
SuiteResult run_mp_vs_single(const SuiteOptions& o);
SuiteResult run_split_sweep(const SuiteOptions& o);
SuiteResult run_dp_scaling(const SuiteOptions& o);
SuiteResult run_pipeline_memory(const SuiteOptions& o);
SuiteResult run_stem_conv(const SuiteOptions& o);
SuiteResult run_transformer(const SuiteOptions& o);
SuiteResult run_llama(const SuiteOptions& o);
SuiteResult run_checkpoint(const SuiteOptions& o);
SuiteResult run_transformer_memory(const SuiteOptions& o);
SuiteResult run_resilience(const SuiteOptions& o);
SuiteResult run_context(const SuiteOptions& o);
SuiteResult run_experts(const SuiteOptions& o);

}  // namespace scaletrain::bench
