#pragma once
// Gradient bucket assignment for DDP: a pure function of parameter sizes, with no process group
// and no tensors, so that it is tested against hand-written tables (tests/bucket_test.cpp).
//
// Note [Bucket order]: parameters are taken in reverse registration order, because backward
// produces the gradients of the last layers first. A bucket holds parameters of one group
// (same dtype and device: one flat tensor) and closes as soon as its size reaches its cap —
// the parameter that crosses the cap is included. The first bucket to close has the small
// first cap, so that the first all-reduce starts early in backward; later ones have the big
// cap. Buckets are numbered in the order they close, which is the order every rank launches
// their all-reduces in.

#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain {

struct BucketParam {
  int64_t bytes = 0;  // numel * element size
  std::string group;  // parameters of different groups (dtype/device) never share a bucket
};

struct BucketOptions {
  int64_t first_cap_bytes = 1 << 20;  // PyTorch's 1 MB
  int64_t cap_bytes = 25 << 20;       // PyTorch's 25 MB
};

/// Buckets as lists of parameter indices (into `params`), in launch order; within a bucket,
/// indices are in the order they were added (descending). Every index appears exactly once.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params,
                                                const BucketOptions& options = {});

}  // namespace scaletrain
