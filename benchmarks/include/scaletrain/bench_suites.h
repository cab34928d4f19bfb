#pragma once
// The benchmark suites of `scaletrain bench`: each reproduces an experiment of the seed
// tutorials and returns every repetition, ready for bench::write_suite().

#include <functional>
#include <string>
#include <vector>

#include "scaletrain/bench.h"

namespace scaletrain::bench {

struct SuiteOptions {
  bool quick = false;    // small sizes: each suite under ~2 minutes on a 2-core CPU
  int repeats = 5;       // timed repetitions per configuration
  std::string self_exe;  // the scaletrain binary, for suites that launch ranks
  std::string work_dir;  // scratch space (worker CSVs, logs)
};

struct Suite {
  std::string name;
  std::string description;
  std::function<SuiteResult(const SuiteOptions&)> run;
};

/// Every suite, in the order `scaletrain bench all` runs them.
const std::vector<Suite>& suites();

/// Worker side of multi-rank suites: runs inside a rank started by the launcher and writes rank
/// 0's samples to `csv_path`. Returns the process exit status.
/// `only`: "" (every path), "gloo", "shm" or "hier"; `bytes` > 0: that one message size.
int run_allreduce_worker(const std::string& csv_path, bool quick, int repeats,
                         const std::string& only = "", int64_t bytes = 0);

/// Worker of the zero suite: `--csv F --mode ddp|1|2|3 [--batch-size B] [--steps N] [--warmup W]
/// [--repeats R]`; rank 0 writes `metric,value` lines to F.
int run_zero_worker(const std::vector<std::string>& args);

/// Worker of the pipeline-ranks suite: `--csv F --schedule gpipe|1f1b|interleaved|zb-h1
/// [--width W] [--batch-size B] [--repeats R] [--quick 0|1]`; rank 0 writes `m,seconds` per timed
/// step to F.
int run_pipeline_ranks_worker(const std::vector<std::string>& args);

/// Worker of the DDP suites: `--csv F [--model M] [--plain 0|1] [--channels-last 0|1]
/// [--batch-size B] [--steps N] [--warmup W] [--repeats R] [--overlap 0|1] [--shared-memory 0|1]
/// [--phases P]`; rank 0 appends samples/s per repetition to F, and with --phases writes
/// milliseconds per step by phase to P (`--plain 1`: the model without model_optimizations).
int run_ddp_worker(const std::vector<std::string>& args);

/// Worker of the transformer suite: `--csv F --mode ddp|tp|tp-sp [--layers L] [--heads H]
/// [--width C] [--context T] [--vocab V] [--batch-size B] [--steps N] [--warmup W]`: the zoo's
/// GPT with AdamW, B sequences over the world (ddp) or on every rank (tp: the world is the
/// tensor-parallel group); rank 0 writes `step,seconds` per timed step, `rss,rank,bytes`,
/// `params,n` and `loss,x` to F.
int run_transformer_worker(const std::vector<std::string>& args);

/// Worker of the experts suite: `--csv F [--dim D] [--hidden H] [--experts E] [--top-k K]
/// [--tokens T] [--steps N] [--warmup W]`: one MoE layer, its experts spread over the world, T
/// tokens per rank; rank 0 writes `step,seconds` per timed step and `loss,x` (the first step's,
/// the ranks' mean) to F.
int run_experts_worker(const std::vector<std::string>& args);

}  // namespace scaletrain::bench
