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
//
// Note [Hierarchical reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A group that spans machines cannot share one segment, but each machine's ranks can share one
// of their own. Ranks are grouped by machine — by what shared memory needs, not by host name:
// the boot id, the device of /dev/shm and the PID namespace, all-gathered once — and a float32
// CPU sum runs in three steps (Horovod's hierarchical all-reduce, with the segment for the
// machine-local parts):
//
//   1. each machine sums its ranks' tensors through its segment (every local rank gets the sum);
//   2. one leader per machine (its lowest rank) all-reduces the machine sums over a backend
//      group of the leaders — the only bytes that cross the network: 2(M-1)/M of the tensor per
//      leader for M machines, where a flat ring over N ranks moves 2(N-1)/N per rank and
//      crosses machines on every ring edge between them;
//   3. the other local ranks zero their copy and the machine sums again through the segment:
//      the leader's result plus zeros, the same bits on every rank of the job.
//
// The decision is collective: every machine's ranks must map their segment (a MIN over the
// world), or every rank uses the backend, as without shared memory.

#include "dist/collectives.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <sys/stat.h>

#include <fstream>
#include <map>

#include "scaletrain/error.h"
#include "transport/shm.h"

namespace scaletrain {
namespace {

// An all-gather's sizes, checked on the caller's rank before any rank waits.
void check_gather(const at::Tensor& out, const at::Tensor& mine, int size,
                  const std::string& what) {
  if (out.numel() != mine.numel() * size || out.scalar_type() != mine.scalar_type()) {
    throw Error(what + ": the all-gather's output holds " + std::to_string(out.numel()) + " " +
                std::string(c10::toString(out.scalar_type())) + " elements, not " +
                std::to_string(size) + " x " + std::to_string(mine.numel()) + " " +
                c10::toString(mine.scalar_type()));
  }
}

// The backend's collectives.
class BackendCollectives : public Collectives {
 public:
  explicit BackendCollectives(Dist dist) : dist_(std::move(dist)) {}

  Pending all_reduce_sum(at::Tensor& t, const std::string& what) override {
    return dist_.all_reduce_async(t, ReduceOp::SUM, what);
  }

  std::vector<int32_t> all_gather_flags(int32_t mine, const std::string& what) override {
    std::vector<int32_t> flags;
    for (auto& t : dist_.all_gather(at::full({1}, mine, at::kInt), what)) {
      flags.push_back(t.item<int32_t>());
    }
    return flags;
  }

  void all_gather_into(at::Tensor& out, const at::Tensor& mine, const std::string& what) override {
    check_gather(out, mine, dist_.size(), what);
    dist_.all_gather_into_tensor_async(out, mine, what).wait();
  }

  bool shared_memory() const override { return false; }
  std::string path() const override { return dist_.backend_name; }

 protected:
  Dist dist_;
};

// Float32 CPU tensors and flags through one shared segment; the rest through the backend.
class SharedMemoryCollectives : public BackendCollectives {
 public:
  SharedMemoryCollectives(Dist dist, std::unique_ptr<SharedGroup> group)
      : BackendCollectives(std::move(dist)), group_(std::move(group)) {}

  Pending all_reduce_sum(at::Tensor& t, const std::string& what) override {
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

  void all_gather_into(at::Tensor& out, const at::Tensor& mine, const std::string& what) override {
    const auto shared = [](const at::Tensor& t) {
      return t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
    };
    if (!shared(out) || !shared(mine)) return BackendCollectives::all_gather_into(out, mine, what);
    check_gather(out, mine, dist_.size(), what);
    group_->allgather(mine.const_data_ptr<float>(), mine.numel(), out.mutable_data_ptr<float>(),
                      what);
  }

  bool shared_memory() const override { return true; }
  std::string path() const override { return "shared memory"; }

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
        dist.store_set(key, "");  // "none": the others need not look
        throw;
      }
      dist.store_set(key, g->name());
    } else {
      const auto name = dist.store_get(key);
      if (!name.empty()) g = SharedGroup::attach(name, o);
    }
  } catch (const Error&) {
    // Not reachable from here: the backend carries everything.
  }
  auto ok = at::full({1}, g ? 1 : 0, at::kInt);
  dist.all_reduce(ok, ReduceOp::MIN, "agreement on a shared-memory segment");
  if (g && dist.rank() == 0) g->unlink();  // every rank mapped it, or nobody will use it
  if (ok.item<int>() != 1) return nullptr;
  return g;
}

// What makes ranks able to share a segment: the same kernel boot, the same /dev/shm, the same
// PID namespace. Hashed to one number.
int64_t machine_key() {
  std::string id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> id;
  struct stat shm {};
  struct stat ns {};
  const bool have_shm = ::stat("/dev/shm", &shm) == 0;
  const bool have_ns = ::stat("/proc/self/ns/pid", &ns) == 0;
  const std::string all = id + "/" + std::to_string(have_shm ? shm.st_dev : 0) + "/" +
                          std::to_string(have_ns ? ns.st_ino : 0);
  return static_cast<int64_t>(std::hash<std::string>{}(all)&0x7fffffffffffffffULL);
}

// Note [Hierarchical reduce].
class HierarchicalCollectives : public BackendCollectives {
 public:
  HierarchicalCollectives(Dist dist, std::unique_ptr<SharedGroup> seg, std::optional<Dist> leaders,
                          int machines)
      : BackendCollectives(std::move(dist)),
        segment_(std::move(seg)),
        leaders_(std::move(leaders)),
        machines_(machines) {}

  Pending all_reduce_sum(at::Tensor& t, const std::string& what) override {
    if (!t.is_cpu() || t.scalar_type() != at::kFloat || !t.is_contiguous()) {
      return BackendCollectives::all_reduce_sum(t, what);
    }
    float* data = t.mutable_data_ptr<float>();
    if (segment_) segment_->allreduce_sum(data, t.numel(), what + " (within the machine)");
    if (leaders_) {
      leaders_->all_reduce(t, ReduceOp::SUM, what + " (between machines)");
    } else {
      t.zero_();
    }
    if (segment_) segment_->allreduce_sum(data, t.numel(), what + " (back within the machine)");
    return {};
  }

  bool shared_memory() const override { return false; }
  std::string path() const override {
    return "hierarchical (" + std::to_string(machines_) + " machines)";
  }

 private:
  std::unique_ptr<SharedGroup> segment_;  // null when this machine has one rank
  std::optional<Dist> leaders_;           // set on the leaders only
  int machines_;
};

// Collective over `dist`: null when the group is on one machine, on one rank per machine, or
// when any machine's ranks cannot share a segment (then every rank returns null).
std::unique_ptr<Collectives> make_hierarchical(const Dist& dist, const std::string& key,
                                               int64_t chunk_floats) {
  if (dist.size() < 3 || dist.backend_name != "gloo") return nullptr;
  const auto keys = dist.all_gather(at::full({1}, machine_key(), at::kLong), "machine identities");
  std::map<int64_t, std::vector<int>> machines;  // key -> ranks, in order of first rank
  std::vector<int64_t> order;
  for (int r = 0; r < dist.size(); ++r) {
    const int64_t k = keys[static_cast<size_t>(r)].item<int64_t>();
    if (!machines.count(k)) order.push_back(k);
    machines[k].push_back(r);
  }
  const int m = static_cast<int>(order.size());
  if (m < 2 || m == dist.size()) return nullptr;  // one machine, or one rank on each
  std::optional<Dist> local;
  for (size_t i = 0; i < order.size(); ++i) {  // every rank makes every group, in one order
    auto g = new_group(dist, machines[order[i]], key + "/machine" + std::to_string(i));
    if (g) local = std::move(g);
  }
  std::vector<int> leader_ranks;
  for (auto k : order) leader_ranks.push_back(machines[k].front());
  auto leaders = new_group(dist, leader_ranks, key + "/leaders");
  std::unique_ptr<SharedGroup> segment;
  bool ok = true;
  if (local && local->size() > 1) {
    segment = open_shared_group(*local, key + "/segment", chunk_floats);
    ok = segment != nullptr;
  }
  auto agree = at::full({1}, ok ? 1 : 0, at::kInt);
  dist.all_reduce(agree, ReduceOp::MIN, "agreement on per-machine segments");
  if (agree.item<int>() != 1) return nullptr;
  // The machine's group was needed to agree on its segment only: the segment works alone.
  return std::make_unique<HierarchicalCollectives>(dist, std::move(segment), std::move(leaders), m);
}

}  // namespace

std::unique_ptr<Collectives> make_collectives(const Dist& dist, const CollectivesOptions& options,
                                              const std::string& key) {
  if (options.shared_memory) {
    if (auto group = open_shared_group(dist, key, options.chunk_floats)) {
      return std::make_unique<SharedMemoryCollectives>(dist, std::move(group));
    }
    if (options.hierarchical) {
      if (auto h = make_hierarchical(dist, key, options.chunk_floats)) return h;
    }
  }
  return std::make_unique<BackendCollectives>(dist);
}

}  // namespace scaletrain
