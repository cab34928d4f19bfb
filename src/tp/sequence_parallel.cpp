// Sequence parallelism's sum of partial gradients (tensor_parallel.h): registered on the
// parameters a sequence-parallel plan leaves whole, performed in every backward.
//
// Note [Partial gradients summed in backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// In a sequence-parallel region each rank holds a slice of the sequence, so a parameter used
// there whole on every rank (a LayerNorm's, a rowwise layer's bias, a position table) gets from
// each rank's backward the part of its gradient that comes from that rank's positions. The whole
// gradient is their sum over the group. A step that forgets the sum trains each rank on its own
// part: nothing fails, and the weights go wrong by a little every step. So the plan does not
// leave the sum to its user: parallelize_module() registers, on every parameter it leaves whole,
// a gradient hook that sums the incoming gradient over the group before it accumulates into
// .grad. Every backward is then whole by the time anything reads .grad: DDP's and ZeRO's hooks
// (which run after the accumulation), an optimizer, a clip, a checkpoint; gradient accumulation
// sums each batch's part once, as it arrives; a pipeline's or activation checkpointing's extra
// backward passes need nothing either. Megatron-LM and Transformer Engine leave this sum to the
// training loop (one flattened all-reduce after backward, which a loop of one's own can leave
// out). The price of doing it in the plan: one all-reduce per such parameter per backward, of
// its own size (the parameters are small: norms, biases, the position table), instead of one
// per step. Every rank of the group runs the same graph, so their hooks, like the split layers'
// own collectives, meet in the same order.
//
// The registry below knows which parameters carry the hook: sync_sequence_parallel_grads(), a
// program's explicit sum after backward (the earlier way), leaves them alone instead of summing
// them a second time, and a later plan that splits such a parameter turns its hook off.
// Regression (SequenceParallelSumForgottenTrainedWrongWeights).
//
// The trainer's strategies, which know where a step ends, defer the sum (partial_sums.h): the
// hooks then let the partial gradients accumulate, and the strategy sums them once per optimizer
// step in one flattened all-reduce after the step's last backward (under ZeRO on its gradient
// shards), as Megatron-LM does: the sum over tp commutes with DDP's and ZeRO's over dp. On a GPT
// of 2 layers at tp 2 on 2 CPU processes a sum per parameter per backward took sequence
// parallelism from 4033 to 2291 tokens/s (`bench transformer --quick`, side by side).

#include <ATen/ops/cat.h>

#include <atomic>
#include <iterator>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "scaletrain/tensor_parallel.h"
#include "tp/partial_sums.h"
#include "tp/split.h"

namespace scaletrain {
namespace {

// One parameter's registered sum: in every backward, deferred to the trainer's step, or off
// once a plan splits the parameter.
enum class SumMode { kInBackward, kDeferred, kOff };
struct PartialSum {
  explicit PartialSum(Dist d) : tp(std::move(d)) {}
  Dist tp;
  std::atomic<SumMode> mode{SumMode::kInBackward};
};

// The parameters that carry the hook, by their TensorImpl (which set_data keeps). An entry
// expires with its parameter: the hook, which owns the PartialSum, dies with the tensor.
class Registry {
 public:
  std::shared_ptr<PartialSum> find(const at::Tensor& p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sums_.find(p.unsafeGetTensorImpl());
    if (it == sums_.end()) return nullptr;
    auto sum = it->second.lock();
    if (!sum) sums_.erase(it);
    return sum;
  }
  void add(const at::Tensor& p, const std::shared_ptr<PartialSum>& sum) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sums_.begin(); it != sums_.end();) {  // models dropped since: forget them
      it = it->second.expired() ? sums_.erase(it) : std::next(it);
    }
    sums_[p.unsafeGetTensorImpl()] = sum;
  }

 private:
  std::mutex mu_;
  std::unordered_map<const void*, std::weak_ptr<PartialSum>> sums_;
};

Registry& registry() {
  static Registry r;
  return r;
}

// The gradients of `params` (those that have one) summed over `tp`, in one flattened all-reduce.
void sum_grads(const std::vector<at::Tensor>& params, const Dist& tp) {
  if (tp.size() == 1) return;
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> owners;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad().reshape({-1}));
    owners.push_back(p);
  }
  if (grads.empty()) return;
  at::Tensor flat = at::cat(grads);
  tp.all_reduce(flat);
  int64_t at = 0;
  for (const auto& p : owners) {
    const int64_t n = p.grad().numel();
    p.mutable_grad().copy_(flat.narrow(0, at, n).view_as(p.grad()));
    at += n;
  }
}

// Whether someone other than sync_sequence_parallel_grads() sums `p`'s gradient.
bool summed_elsewhere(const at::Tensor& p) {
  auto sum = registry().find(p);
  return sum && sum->mode != SumMode::kOff;
}

}  // namespace

void sum_partial_gradients(const std::vector<at::Tensor>& params, const Dist& tp) {
  if (tp.size() == 1) return;
  for (const auto& p : params) {
    if (!p.defined() || !p.requires_grad()) continue;
    if (auto existing = registry().find(p)) {  // registered already: never a second sum
      existing->mode = SumMode::kInBackward;
      continue;
    }
    auto sum = std::make_shared<PartialSum>(tp);
    p.register_hook([sum](const at::Tensor& grad) -> at::Tensor {
      if (sum->mode != SumMode::kInBackward || !grad.defined()) return grad;
      at::Tensor whole = grad.contiguous().clone();
      sum->tp.all_reduce(whole);
      return whole;
    });
    registry().add(p, sum);
  }
}

void stop_summing_partial_gradients(const at::Tensor& param) {
  if (auto sum = registry().find(param)) sum->mode = SumMode::kOff;
}

void defer_partial_sums(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    auto sum = registry().find(p);
    auto in_backward = SumMode::kInBackward;
    if (sum) sum->mode.compare_exchange_strong(in_backward, SumMode::kDeferred);
  }
}

bool partial_sum_deferred(const at::Tensor& param) {
  auto sum = registry().find(param);
  return sum && sum->mode == SumMode::kDeferred;
}

void sum_deferred_partial_gradients(const std::vector<at::Tensor>& params, const Dist& tp) {
  std::vector<at::Tensor> deferred;
  for (const auto& p : params) {
    if (partial_sum_deferred(p)) deferred.push_back(p);
  }
  sum_grads(deferred, tp);
}

void sync_sequence_parallel_grads(const std::vector<at::Tensor>& params, const Dist& tp) {
  std::vector<at::Tensor> mine;
  for (const auto& p : params) {
    if (!summed_elsewhere(p)) mine.push_back(p);
  }
  sum_grads(mine, tp);
}

}  // namespace scaletrain
