// Input for Structure.CheckerFindsC10d: c10d used around Dist, which scripts/check-structure.py
// must report (twice); the mentions in this comment, c10d:: and dist.backend->, do not count.
#include "scaletrain/dist.h"

void sum(const scaletrain::Dist& dist, at::Tensor& t) {
  const char* note = "dist.backend->allreduce";  // a string: does not count
  std::vector<at::Tensor> v{t};
  dist.backend->allreduce(v)->wait();
  dist.all_reduce(t, c10d::ReduceOp::MAX);
}
