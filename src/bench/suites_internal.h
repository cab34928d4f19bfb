#pragma once
// The suite functions behind bench::suites() (one file per suite in src/bench/).

#include "scaletrain/bench_suites.h"

namespace scaletrain::bench {

SuiteResult run_allreduce(const SuiteOptions& o);
SuiteResult run_async(const SuiteOptions& o);
SuiteResult run_ddp_vs_python(const SuiteOptions& o);
SuiteResult run_ddp_overlap(const SuiteOptions& o);

}  // namespace scaletrain::bench
