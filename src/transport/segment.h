#pragma once
// What the shared-memory transports (shm.cpp, link.cpp) share: named segments in /dev/shm and
// futex waits (internal, LibTorch-free).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <string>

namespace scaletrain {
namespace shm {

/// A mapped segment; `name` is its /dev/shm name.
struct Segment {
  std::string name;
  void* base = nullptr;
  size_t bytes = 0;
};

/// A fresh zero-filled segment of `bytes`, its name starting with "/scaletrain-": all of it
/// allocated now (a full /dev/shm is an Error here, not a SIGBUS later). Throws Error.
Segment create(size_t bytes);
/// Maps the segment `name`, which must be `bytes` long. Throws Error when it does not exist
/// (another machine) or has another size.
Segment open(const std::string& name, size_t bytes);

/// Unmaps it.
void close(const Segment& segment);

/// Removes the segments that process `pid` of this PID namespace created and left (their names
/// begin "/scaletrain-<pid>-<pid_namespace()>-"), for a launcher whose worker died before it
/// unlinked them (SIGKILL); a process with the same pid in another namespace sharing /dev/shm
/// keeps its own.
/// Only for a pid that has exited and that the caller knows: a live process's peers may still
/// open its segments. Returns how many it removed.
int remove_segments_of(int pid);

/// This process's PID namespace (0 where unknown): ranks that share a segment check it, so that
/// a pid read from the segment means the same process to both.
uint64_t pid_namespace();
/// Whether the process `pid` has exited (same PID namespace).
bool exited(int pid);

/// FUTEX_WAIT on `word` while it holds `value`, for at most `nap`; FUTEX_WAKE of every waiter.
void wait(std::atomic<uint32_t>* word, uint32_t value, const timespec& nap);
void wake(std::atomic<uint32_t>* word);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline size_t align_up(size_t n, size_t to = 64) { return (n + to - 1) / to * to; }

}  // namespace shm
}  // namespace scaletrain
