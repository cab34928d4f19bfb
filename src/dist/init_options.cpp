// The process group's options checked before any process starts (dist.h): a program that
// launches its own ranks (scaletrain train started by hand) refuses a bad backend with one
// message and exit 2, instead of every rank failing after the launcher started it.

#include <string>

#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "scaletrain/version.h"

namespace scaletrain {

void validate(const InitOptions& o) {
  if (o.backend != "gloo" && o.backend != "nccl" && o.backend != "auto") {
    throw UsageError("unknown backend '" + o.backend +
                     "'; use gloo (any device), nccl (a GPU per process) or auto");
  }
  if (o.backend == "nccl" && !built_with_cuda()) {
    throw UsageError(
        "backend 'nccl' is not available: this scaletrain was built without CUDA; use gloo");
  }
  if (o.backend == "nccl" && cuda_device_count() == 0) {
    throw UsageError(
        "backend 'nccl' needs a CUDA GPU and none is visible here; use gloo (or "
        "auto) on the CPU");
  }
  if (o.timeout.count() <= 0) {
    throw UsageError("InitOptions::timeout " + std::to_string(o.timeout.count()) +
                     " ms must be positive: how long a collective may wait");
  }
  if (o.rendezvous_timeout.count() <= 0) {
    throw UsageError("InitOptions::rendezvous_timeout " +
                     std::to_string(o.rendezvous_timeout.count()) +
                     " ms must be positive: how long rendezvous waits for every rank");
  }
  if (o.heartbeat_interval.count() < 0) {
    throw UsageError("InitOptions::heartbeat_interval " +
                     std::to_string(o.heartbeat_interval.count()) +
                     " ms must be 0 (no heartbeat) or positive");
  }
}

}  // namespace scaletrain
