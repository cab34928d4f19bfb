#pragma once
// Collectives through one shared-memory segment, for the ranks of a group that run on one
// machine (internal, not public API; LibTorch-free). Note [Shared-memory reduce] in shm.cpp.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace scaletrain {

class SharedGroup {
 public:
  struct Options {
    int rank = 0;
    int size = 1;
    int64_t chunk_floats = 1 << 18;  // floats per rank and round of an all-reduce
    std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // per collective
  };

  /// Rank 0: a fresh segment, sized for `options`. Throws Error when it cannot be made.
  static std::unique_ptr<SharedGroup> create(const Options& options);
  /// The other ranks: map the segment rank 0 made (`name()` there). Throws Error when it is not
  /// reachable from here: another machine, another PID namespace, another group size.
  static std::unique_ptr<SharedGroup> attach(const std::string& name, const Options& options);

  /// Marks this rank as gone (a rank waiting for it fails at once) and unmaps.
  ~SharedGroup();
  SharedGroup(const SharedGroup&) = delete;
  SharedGroup& operator=(const SharedGroup&) = delete;

  const std::string& name() const { return name_; }
  /// Removes the name once every rank has mapped the segment; the memory stays until the last
  /// rank unmaps it, and nothing is left behind if a rank is killed.
  void unlink();

  /// In place, on every rank: data[0, n) = the sum of every rank's data[0, n), added in rank
  /// order, so every rank gets the same bits. Collective; `what` names it in errors.
  void allreduce_sum(float* data, int64_t n, const std::string& what);
  /// Every rank's `mine`, by rank. Collective.
  std::vector<int32_t> allgather(int32_t mine, const std::string& what);
  /// out[r·n, (r+1)·n) = rank r's mine[0, n), on every rank: every rank's bits, nothing summed.
  /// Collective; every rank gives the same n; `out` holds size·n floats and may not overlap
  /// `mine`.
  void allgather(const float* mine, int64_t n, float* out, const std::string& what);

  struct Layout;

 private:
  SharedGroup(std::string name, const Options& options, void* base, size_t bytes);
  void barrier(const std::string& what);
  [[noreturn]] void fail(const std::string& what, const std::string& why) const;

  std::string name_;
  Options options_;
  void* base_;
  size_t bytes_;
  uint64_t barriers_ = 0;   // barriers this rank has passed
  uint32_t exchanges_ = 0;  // allgathers so far (their slots alternate)
};

}  // namespace scaletrain
