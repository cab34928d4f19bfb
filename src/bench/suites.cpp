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
      {"ddp-vs-python",
       "LeNet on Fashion-MNIST: scaletrain DDP vs PyTorch's Python DDP, 1 and 2 "
       "processes",
       run_ddp_vs_python},
      {"ddp-overlap",
       "small-image ResNet-18 on 2 processes: all-reduce overlapped with "
       "backward vs after it",
       run_ddp_overlap},
  };
  return all;
}

}  // namespace scaletrain::bench
