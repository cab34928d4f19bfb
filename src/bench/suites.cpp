#include "suites_internal.h"

namespace scaletrain::bench {

const std::vector<Suite>& suites() {
  static const std::vector<Suite> all = {
      {"async",
       "seed 004: synchronised vs unsynchronised timing, all devices at once, "
       "device-to-host copies with and without non_blocking",
       run_async},
      {"allreduce", "all-reduce bus bandwidth over 2..N ranks, 4 KB and up, vs memory copy",
       run_allreduce},
  };
  return all;
}

}  // namespace scaletrain::bench
