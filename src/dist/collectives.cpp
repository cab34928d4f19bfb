// Note [Collectives]
// ~~~~~~~~~~~~~~~~~~
// DDP's reducer sums gradient buckets and exchanges uneven-input flags. Over c10d (Gloo or NCCL)
// both are asynchronous collectives of the backend. Ranks that share a machine can do better for
// float32 CPU tensors: one /dev/shm segment, a copy in, a sum in rank order, a copy out (Note
// [Shared-memory reduce] in src/transport/shm.cpp) — ~0.2 ms instead of 2.4 ms over Gloo's
// loopback sockets for LeNet's 516 KB bucket. The choice is made once, collectively, when the
// collectives are made: rank 0 creates the segment and posts its name in the store, the others
// map it, and a MIN all-reduce over "mapped it" decides for every rank at once, so that no rank
// takes the shared path while another takes the backend's. Tensors the segment does not carry
// (other dtypes, CUDA) go through the backend either way, on every rank alike.

#include "dist/collectives.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include "scaletrain/error.h"
#include "transport/shm.h"

namespace scaletrain {
namespace {

// The backend's collectives.
class BackendCollectives : public Collectives {
 public:
  explicit BackendCollectives(Dist dist) : dist_(std::move(dist)) {}

  c10::intrusive_ptr<c10d::Work> all_reduce_sum(at::Tensor& t, const std::string&) override {
    std::vector<at::Tensor> v{t};
    return dist_.backend->allreduce(v);
  }

  std::vector<int32_t> all_gather_flags(int32_t mine, const std::string& what) override {
    std::vector<at::Tensor> in{at::full({1}, mine, at::kInt)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < dist_.size(); ++r) out[0].push_back(at::empty({1}, at::kInt));
    wait_for(dist_.backend->allgather(out, in), what, dist_);
    std::vector<int32_t> flags;
    for (auto& t : out[0]) flags.push_back(t.item<int32_t>());
    return flags;
  }

  bool shared_memory() const override { return false; }

 protected:
  Dist dist_;
};

// Float32 CPU tensors and flags through one shared segment; the rest through the backend.
class SharedMemoryCollectives : public BackendCollectives {
 public:
  SharedMemoryCollectives(Dist dist, std::unique_ptr<SharedGroup> group)
      : BackendCollectives(std::move(dist)), group_(std::move(group)) {}

  c10::intrusive_ptr<c10d::Work> all_reduce_sum(at::Tensor& t, const std::string& what) override {
    if (!t.is_cpu() || t.scalar_type() != at::kFloat || !t.is_contiguous()) {
      return BackendCollectives::all_reduce_sum(t, what);
    }
    // Synchronous: a sum through memory has no latency worth hiding.
    group_->allreduce_sum(t.mutable_data_ptr<float>(), t.numel(), what);
    return {};
  }

  std::vector<int32_t> all_gather_flags(int32_t mine, const std::string& what) override {
    return group_->allgather(mine, what);
  }

  bool shared_memory() const override { return true; }

 private:
  std::unique_ptr<SharedGroup> group_;
};

// Rank 0 makes the segment and posts its name under `key`; the others map it; all agree (MIN
// over "mapped it") so that every rank has it or none does. Null for one rank, for a backend
// other than Gloo, or where any rank cannot map it (another machine, another PID namespace, no
// room in /dev/shm).
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

}  // namespace

std::unique_ptr<Collectives> make_collectives(const Dist& dist, const CollectivesOptions& options,
                                              const std::string& key) {
  if (options.shared_memory) {
    if (auto group = open_shared_group(dist, key, options.chunk_floats)) {
      return std::make_unique<SharedMemoryCollectives>(dist, std::move(group));
    }
  }
  return std::make_unique<BackendCollectives>(dist);
}

}  // namespace scaletrain
