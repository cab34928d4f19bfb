#pragma once
// A scoped LibTorch intra-op thread count.

#include <ATen/Parallel.h>

namespace scaletrain {

/// Sets LibTorch's intra-op thread count for a scope and restores the previous one after, also
/// when the scope is left by an exception (or a failed test assertion).
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int n) : saved_(at::get_num_threads()) { at::set_num_threads(n); }
  ~IntraOpThreads() { at::set_num_threads(saved_); }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  int saved_;
};

}  // namespace scaletrain
