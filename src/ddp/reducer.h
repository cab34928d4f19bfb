#pragma once
// The reducer behind DistributedDataParallel (internal). Note [Reducer] in reducer.cpp.

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dist/collectives.h"
#include "scaletrain/bucket.h"
#include "scaletrain/ddp.h"

namespace scaletrain {

struct DistributedDataParallel::Reducer {
  Reducer(Dist dist, DDPOptions options, std::vector<at::Tensor> params,
          std::vector<std::string> names);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// After forward: reset the step's state; with find_unused_parameters, trace `outputs`.
  void prepare(const std::vector<at::Tensor>& outputs);

  struct Bucket {
    at::Tensor flat;     // the gradients of its parameters, back to back
    at::Tensor wire;     // compressed copy sent over the wire (fp16/bf16 hooks)
    size_t pending = 0;  // parameters still without gradient in this backward
    bool launched = false;
    Pending work;  // the sum in flight
  };

  Dist dist;
  DDPOptions opts;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<std::vector<size_t>> assignment;  // bucket -> parameter indices
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;  // parameter -> bucket
  std::vector<at::Tensor> views;  // parameter -> its slice of the bucket, shaped like it
  std::vector<bool> ready;        // gradient complete in this backward
  std::vector<bool> used;         // reached from the outputs (find_unused_parameters)
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks;
  size_t next_launch = 0;
  bool sync = true;        // false inside no_sync()
  bool expecting = false;  // a DDP forward happened; its backward is due
  bool callback_queued = false;
  int64_t round = 0;    // forwards so far, for store keys
  int64_t divisor = 1;  // buckets are divided by this before they are summed: the world size,
                        // or the ranks that took the step (Note [Uneven inputs])
  std::mutex mu;
  std::unique_ptr<Collectives> comm;  // Note [Collectives]

  /// Every rank's `mine` (the uneven-input flags).
  std::vector<int32_t> exchange_flags(int32_t mine, const std::string& what);
  /// Collective: the collectives of the instance-th DDP of this group (shared memory for float32
  /// CPU buckets where every rank can map one segment, DDPOptions::shared_memory).
  void open_collectives(int instance);
  /// A joined rank's part in another rank's backward (Note [Uneven inputs]): every bucket's
  /// all-reduce, in order, with zeros, and the used-parameter map's with zeros.
  void shadow_backward();

 private:
  void on_gradient(size_t i);
  void attach(size_t i);
  void mark_ready(size_t i);
  void launch(size_t k);
  void finalize();
  void drop_globally_unused();
  [[noreturn]] void report_missing(const std::vector<size_t>& missing);
};

}  // namespace scaletrain
