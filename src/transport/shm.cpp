// Note [Shared-memory reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Ranks on one machine that all-reduce over Gloo pass their data through TCP on the loopback
// device and hand it between three threads per process (caller, Gloo worker, transport loop):
// a LeNet gradient bucket (516 KB) takes 2.4 ms, a 4-byte all-gather 0.8 ms, a noticeable part
// of a ~85 ms CPU step. Through one shared segment the same all-reduce is a copy in, a sum, a
// copy out and two barriers, on the caller's thread:
//
//   segment:  header | per rank: pid, gone, barriers passed, flags | slot 0 .. n-1 | sum
//   round:    copy my chunk to my slot -> barrier -> sum my 1/n of the chunk over the slots,
//             in rank order, into "sum" -> barrier -> copy the whole "sum" back
//
// An all-gather of floats is the same round without the sum: copy my part to my slot -> barrier
// -> copy every slot to its place -> barrier.
//
// Every element is added by one rank in rank order, so every rank gets the same bits. A rank
// writes its slot again only after the second barrier of the round before, which every rank
// passes only when done reading the slots; it writes "sum" again only after the next round's
// first barrier, which every rank reaches only when done copying "sum" out. All-gathers use
// two alternating flag slots per rank: between an all-gather and the next-but-one there is
// always a barrier that waits for every reader.
//
// The barrier is a counter and a generation word: the last rank to arrive resets the counter,
// bumps the generation and wakes the sleepers (futex). Waiters spin ~50 us, then sleep on the
// generation in 20 ms naps; after each nap they look for trouble, so a wait never hangs: a
// rank marked gone (its group was destroyed, e.g. while its thread unwound an error), a rank
// whose process is dead (kill(pid, 0): same PID namespace, checked at attach), or the
// collective timeout passed; the error names the ranks that never arrived.

#include "transport/shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <random>
#include <sstream>

#include "runtime/proc_tree.h"
#include "scaletrain/error.h"
#include "transport/segment.h"

namespace scaletrain {
namespace {

constexpr uint64_t kMagic = 0x7363616c65736d31ULL;  // "scalesm1"
constexpr size_t kAlign = 64;

using shm::align_up;
using shm::cpu_relax;
using shm::pid_namespace;

}  // namespace

struct SharedGroup::Layout {
  struct Header {
    uint64_t magic;
    uint64_t pid_ns;
    int64_t size;
    int64_t chunk_floats;
    alignas(kAlign) std::atomic<uint32_t> arrived;
    alignas(kAlign) std::atomic<uint32_t> generation;
  };
  struct alignas(kAlign) Rank {
    std::atomic<int32_t> pid;
    std::atomic<int32_t> gone;
    std::atomic<uint64_t> barriers;  // barriers this rank has arrived at
    std::atomic<int32_t> flags[2];
  };
  static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                    std::atomic<uint64_t>::is_always_lock_free,
                "shared-memory atomics must be lock-free");

  static size_t ranks_offset() { return align_up(sizeof(Header)); }
  static size_t data_offset(int64_t size) {
    return align_up(ranks_offset() + static_cast<size_t>(size) * sizeof(Rank));
  }
  static size_t chunk_bytes(int64_t chunk_floats) {
    return align_up(static_cast<size_t>(chunk_floats) * sizeof(float));
  }
  static size_t bytes(int64_t size, int64_t chunk_floats) {
    return data_offset(size) + static_cast<size_t>(size + 1) * chunk_bytes(chunk_floats);
  }

  static Header& header(void* base) { return *static_cast<Header*>(base); }
  static Rank& rank(void* base, int r) {
    return reinterpret_cast<Rank*>(static_cast<char*>(base) + ranks_offset())[r];
  }
  // Slot r (0 <= r < size), or the sum (r == size).
  static float* slot(void* base, int64_t size, int64_t chunk_floats, int64_t r) {
    return reinterpret_cast<float*>(static_cast<char*>(base) + data_offset(size) +
                                    static_cast<size_t>(r) * chunk_bytes(chunk_floats));
  }
};

namespace {

using Layout = SharedGroup::Layout;

}  // namespace

SharedGroup::SharedGroup(std::string name, const Options& options, void* base, size_t bytes)
    : name_(std::move(name)), options_(options), base_(base), bytes_(bytes) {
  Layout::rank(base_, options_.rank).pid.store(static_cast<int32_t>(getpid()));
}

std::unique_ptr<SharedGroup> SharedGroup::create(const Options& o) {
  if (o.size < 1 || o.rank != 0 || o.chunk_floats < 1) {
    throw Error("SharedGroup::create: rank 0 of a group of at least one, chunk >= 1");
  }
  const auto seg = shm::create(Layout::bytes(o.size, o.chunk_floats));
  void* base = seg.base;
  auto& h = Layout::header(base);  // zero-filled: counters at 0, nobody gone
  h.magic = kMagic;
  h.pid_ns = pid_namespace();
  h.size = o.size;
  h.chunk_floats = o.chunk_floats;
  return std::unique_ptr<SharedGroup>(new SharedGroup(seg.name, o, base, seg.bytes));
}

std::unique_ptr<SharedGroup> SharedGroup::attach(const std::string& name, const Options& o) {
  const size_t bytes = Layout::bytes(o.size, o.chunk_floats);
  void* base = shm::open(name, bytes).base;
  const auto& h = Layout::header(base);
  if (h.magic != kMagic || h.size != o.size || h.chunk_floats != o.chunk_floats ||
      h.pid_ns != pid_namespace() || o.rank <= 0 || o.rank >= o.size) {
    munmap(base, bytes);
    throw Error("shared segment " + name + " belongs to another group or PID namespace");
  }
  return std::unique_ptr<SharedGroup>(new SharedGroup(name, o, base, bytes));
}

SharedGroup::~SharedGroup() {
  Layout::rank(base_, options_.rank).gone.store(1);
  shm::wake(&Layout::header(base_).generation);  // waiters look now
  munmap(base_, bytes_);
}

void SharedGroup::unlink() { shm_unlink(name_.c_str()); }

void SharedGroup::fail(const std::string& what, const std::string& why) const {
  throw Error("rank " + std::to_string(options_.rank) + " of " + std::to_string(options_.size) +
              ": " + what + " " + why);
}

void SharedGroup::barrier(const std::string& what) {
  auto& h = Layout::header(base_);
  const uint32_t gen = h.generation.load(std::memory_order_acquire);
  Layout::rank(base_, options_.rank).barriers.store(++barriers_, std::memory_order_relaxed);
  if (h.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 ==
      static_cast<uint32_t>(options_.size)) {
    h.arrived.store(0, std::memory_order_relaxed);
    h.generation.fetch_add(1, std::memory_order_release);
    shm::wake(&h.generation);
    return;
  }
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (int i = 0; clock::now() - start < std::chrono::microseconds(50); ++i) {
    for (int k = 0; k < 64; ++k) {
      if (h.generation.load(std::memory_order_acquire) != gen) return;
      cpu_relax();
    }
  }
  const auto deadline = start + options_.timeout;
  const timespec nap{0, 20 * 1000 * 1000};
  while (true) {
    shm::wait(&h.generation, gen, nap);
    if (h.generation.load(std::memory_order_acquire) != gen) return;
    // A rank that arrived cannot leave before the generation moves: whoever is gone or dead
    // now never arrived.
    std::string missing, stopped;
    for (int r = 0; r < options_.size; ++r) {
      const auto& rs = Layout::rank(base_, r);
      if (r == options_.rank || rs.barriers.load(std::memory_order_relaxed) >= barriers_) continue;
      const int pid = rs.pid.load();
      std::string why;
      if (rs.gone.load() != 0) {
        why =
            "left the group (its DistributedDataParallel was destroyed, e.g. by an error) "
            "before joining it";
      } else if (shm::exited(pid)) {
        why = "(pid " + std::to_string(pid) + ") exited before joining it";
      }
      if (!why.empty()) {
        if (h.generation.load(std::memory_order_acquire) != gen) return;
        fail(what, "failed: rank " + std::to_string(r) + " " + why +
                       ". Its own error, above or in its log, says why.");
      }
      missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      if (proc::is_stopped(pid)) {
        stopped += "; rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                   ") is stopped by a signal (SIGSTOP, a debugger): `kill -CONT " +
                   std::to_string(pid) + "` lets it go on";
      }
    }
    if (clock::now() > deadline) {
      fail(what,
           "timed out after " +
               std::to_string(
                   std::chrono::duration_cast<std::chrono::seconds>(options_.timeout).count()) +
               " s (collective timeout): rank(s) " + missing + " never joined it" + stopped +
               ". Look for a rank that stalled or took another code "
               "path; raise the timeout if the work is just slow (`scaletrain train --timeout "
               "SECONDS`, or InitOptions::timeout in a program).");
    }
  }
}

void SharedGroup::allreduce_sum(float* data, int64_t n, const std::string& what) {
  const int64_t size = options_.size, chunk = options_.chunk_floats;
  float* mine = Layout::slot(base_, size, chunk, options_.rank);
  float* __restrict sum = Layout::slot(base_, size, chunk, size);
  for (int64_t offset = 0; offset < n; offset += chunk) {
    const int64_t c = std::min(chunk, n - offset);
    std::memcpy(mine, data + offset, static_cast<size_t>(c) * sizeof(float));
    barrier(what);
    const int64_t lo = c * options_.rank / size, hi = c * (options_.rank + 1) / size;
    const float* __restrict first = Layout::slot(base_, size, chunk, 0);
    for (int64_t i = lo; i < hi; ++i) sum[i] = first[i];
    for (int64_t r = 1; r < size; ++r) {
      const float* __restrict s = Layout::slot(base_, size, chunk, r);
      for (int64_t i = lo; i < hi; ++i) sum[i] += s[i];
    }
    barrier(what);
    std::memcpy(data + offset, sum, static_cast<size_t>(c) * sizeof(float));
  }
}

void SharedGroup::allgather(const float* mine, int64_t n, float* out, const std::string& what) {
  const int64_t size = options_.size, chunk = options_.chunk_floats;
  float* slot = Layout::slot(base_, size, chunk, options_.rank);
  for (int64_t offset = 0; offset < n; offset += chunk) {
    const int64_t c = std::min(chunk, n - offset);
    std::memcpy(slot, mine + offset, static_cast<size_t>(c) * sizeof(float));
    barrier(what);
    for (int64_t r = 0; r < size; ++r) {
      std::memcpy(out + r * n + offset, Layout::slot(base_, size, chunk, r),
                  static_cast<size_t>(c) * sizeof(float));
    }
    barrier(what);  // every rank has read the slots: the next round (or collective) may write
  }
}

std::vector<int32_t> SharedGroup::allgather(int32_t mine, const std::string& what) {
  const uint32_t k = exchanges_++ % 2;
  Layout::rank(base_, options_.rank).flags[k].store(mine, std::memory_order_relaxed);
  barrier(what);
  std::vector<int32_t> all(static_cast<size_t>(options_.size));
  for (int r = 0; r < options_.size; ++r) {
    all[static_cast<size_t>(r)] = Layout::rank(base_, r).flags[k].load(std::memory_order_relaxed);
  }
  return all;
}

}  // namespace scaletrain
