#include "shared_group.h"

#include <ATen/ops/full.h>

#include <vector>

#include "scaletrain/error.h"

namespace scaletrain {

std::unique_ptr<SharedGroup> open_shared_group(const Dist& dist, const std::string& key,
                                               int64_t chunk_floats) {
  if (dist.size() < 2 || dist.backend_name != "gloo") return nullptr;
  SharedGroup::Options o;
  o.rank = dist.rank();
  o.size = dist.size();
  o.chunk_floats = std::max<int64_t>(chunk_floats, 1);
  if (dist.timeout.count() > 0) o.timeout = dist.timeout;
  std::unique_ptr<SharedGroup> g;
  try {
    if (dist.rank() == 0) {
      try {
        g = SharedGroup::create(o);
      } catch (const Error&) {
        dist.store->set(key, std::vector<uint8_t>{});  // "none": the others need not look
        throw;
      }
      const auto& name = g->name();
      dist.store->set(key, std::vector<uint8_t>(name.begin(), name.end()));
    } else {
      const auto v = dist.store->get(key);
      if (!v.empty()) g = SharedGroup::attach(std::string(v.begin(), v.end()), o);
    }
  } catch (const Error&) {
    // Not reachable from here: the backend carries everything.
  }
  std::vector<at::Tensor> ok{at::full({1}, g ? 1 : 0, at::kInt)};
  c10d::AllreduceOptions ao;
  ao.reduceOp = c10d::ReduceOp::MIN;
  wait_for(dist.backend->allreduce(ok, ao), "agreement on a shared-memory segment", dist);
  if (g && dist.rank() == 0) g->unlink();  // every rank mapped it, or nobody will use it
  if (ok[0].item<int>() != 1) return nullptr;
  return g;
}

}  // namespace scaletrain
