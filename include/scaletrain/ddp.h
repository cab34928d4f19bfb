#pragma once
// DistributedDataParallel for any torch::nn::Module: every rank holds a replica, runs forward
// and backward on its own slice of the batch, and gradients are averaged across ranks while
// backward is still running, bucket by bucket (Note [Bucket order] in bucket.h).
//
//   auto dist = scaletrain::init_process_group();
//   auto model = std::make_shared<Net>();
//   scaletrain::DistributedDataParallel ddp(model, dist);      // checks + broadcasts rank 0's
//   torch::optim::SGD opt(model->parameters(), 0.1);
//   for (auto& [x, y] : my_slice_of_the_data) {
//     opt.zero_grad();
//     auto out = ddp(x);                                          // model->forward(x), as a step
//     torch::nn::functional::cross_entropy(out, y).backward();   // all-reduces overlap this
//     opt.step();                                                 // gradients are averaged
//   }
//   ddp.join();   // see "Uneven inputs" below
//
// Contract: construct it on every rank, in the same order as any other DDP instance, after the
// module's parameters are final (it keeps pointers to them). The module must outlive it. One
// thread drives a given instance; autograd may run its hooks on other threads. Gradients are
// ready (averaged over the world) when backward() returns.
//
// Note [Armed backward]: every backward of the module's parameters must follow a DDP step —
// ddp(x), ddp.forward(...), or prepare_for_backward(outputs) for outputs computed elsewhere —
// or run inside no_sync(). A backward that reaches the parameters otherwise (the module called
// directly, model->forward(x)) would leave this rank's gradients un-averaged and the replicas
// would drift apart without a word; it throws instead, from backward(), naming the fix.
//
// Unused parameters: with find_unused_parameters, forward's outputs are traced back through
// the autograd graph; parameters not reached count as ready with zero gradient, and those that
// no rank used keep no gradient at all (as in a single process). Without it, a backward that
// leaves parameters without gradient fails with an error listing them per rank and naming
// the option.
//
// Uneven inputs (Note [Uneven inputs]): every forward first exchanges one flag per rank ("I have
// a batch"), and a rank that ran out of data calls join(). With UnevenInputs::kFail (the
// default), if some ranks joined while others still step, every rank throws an Error naming the
// ranks that ran out and the step — no hang. With kJoin (PyTorch's Join), joined ranks shadow
// the others' collectives with zero gradients until every rank has joined, and join() ends by
// broadcasting the weights of the last rank to join. Make inputs even with DistributedSampler
// (padding or drop_last). Cost: one tiny all-gather per step (microseconds through shared
// memory).
//
// Same-machine ranks (Note [Shared-memory reduce] in src/transport/shm.cpp): with shared_memory
// (the default) and the Gloo backend, ranks that can all map one /dev/shm segment sum float32 CPU
// gradient buckets and exchange the uneven-input flags through it, on the calling thread,
// instead of through Gloo's sockets: ~0.2 ms instead of 2.4 ms for a 516 KB bucket. Every rank
// gets the same bits. Where the ranks span machines, with `hierarchical` (the default) each
// machine sums through a segment of its own and one leader per machine all-reduces the machine
// sums over the backend, then hands the result back through the segment: only the leaders'
// bytes cross the network. Where any machine's ranks cannot map their segment, all use the
// backend.

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "scaletrain/dist.h"
#include "scaletrain/module_call.h"

namespace scaletrain {

enum class CommHook {
  kNone,  // all-reduce fp32 (or the parameters' dtype) gradients
  kFp16,  // cast buckets to float16 for the wire, then back: half the bytes
  kBf16,  // bfloat16 on the wire
};

/// What DDP does when ranks run out of batches at different steps (Note [Uneven inputs]).
enum class UnevenInputs {
  kFail,  // every rank throws in that step, naming the ranks that ran out (the default)
  kJoin,  // ranks that ran out shadow the others' all-reduces with zero gradients until all
          // have joined (PyTorch's Join); join() then gives every rank the weights of the last
          // rank to join. Optimizer state (momentum) of the joined ranks is not synchronised.
  kOff,   // no per-step check (one all-gather less per step); uneven inputs then hang in the
          // next collective until the collective timeout
};

struct DDPOptions {
  double bucket_cap_mb = 25;
  double first_bucket_cap_mb = 1;
  bool broadcast_buffers = true;  // rank 0's buffers (BatchNorm stats...) before forward
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = true;  // .grad is a view into its bucket: no copies
  CommHook comm_hook = CommHook::kNone;
  bool overlap = true;  // false: all-reduce only after backward (a baseline)
  UnevenInputs uneven_inputs = UnevenInputs::kFail;
  /// kJoin: a step that only some ranks took divides the summed gradients by the world size
  /// (true, PyTorch's default: every sample weighs what it weighs in an even step) or by the
  /// number of ranks that took it (false: the mean over the samples that were there).
  bool divide_by_initial_world_size = true;
  int check_replicas_every = 0;  // >0: replica drift check every N forwards
  bool shared_memory = true;     // same-machine ranks reduce CPU float32 buckets through /dev/shm
  bool hierarchical = true;      // with shared_memory, across machines: within each machine
                                 // through its segment, between machines by one leader each
  /// Parameters (by the module's names) DDP leaves alone: not checked, broadcast, reduced or
  /// compared, PyTorch's params_and_buffers_to_ignore. For parameters that differ by rank on
  /// purpose, whose gradients the program averages itself (expert parallelism's experts).
  std::set<std::string> ignored_parameters;
};

class DistributedDataParallel {
 public:
  /// Verifies that every rank has the same parameters (count, names, shapes, dtypes) — or
  /// throws on every rank an Error naming the first mismatch and the ranks — then broadcasts
  /// rank 0's parameters and buffers, assigns buckets and installs the gradient hooks.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, Dist dist,
                          DDPOptions options = {});
  /// The same for a module of a known type: when its type has `at::Tensor forward(const
  /// at::Tensor&)`, DDP is then called like the module, ddp(x).
  template <typename M, typename = std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>>>
  DistributedDataParallel(std::shared_ptr<M> module, Dist dist, DDPOptions options = {})
      : DistributedDataParallel(std::static_pointer_cast<torch::nn::Module>(module),
                                std::move(dist), options) {
    if constexpr (has_tensor_forward_v<M>) {
      call_ = [m = module.get()](const at::Tensor& x) -> at::Tensor { return m->forward(x); };
    }
  }
  /// A module holder (torch::nn::Sequential, torch::nn::Linear, TORCH_MODULE(Net)...).
  template <typename Impl>
  DistributedDataParallel(torch::nn::ModuleHolder<Impl> module, Dist dist, DDPOptions options = {})
      : DistributedDataParallel(module.ptr(), std::move(dist), options) {}
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// The module's forward on `input`, as a DDP step. Needs a module whose type has `at::Tensor
  /// forward(const at::Tensor&)` (given to the constructor as such); throws UsageError otherwise.
  at::Tensor forward(const at::Tensor& input);
  at::Tensor operator()(const at::Tensor& input) { return forward(input); }
  /// Runs one forward pass as a DDP step: `fn` calls the module (any signature) and returns its
  /// output, e.g. ddp.forward([&] { return model->forward(x, mask); }).
  at::Tensor forward(const std::function<at::Tensor()>& fn);
  /// The same for modules returning several tensors.
  std::vector<at::Tensor> forward_many(const std::function<std::vector<at::Tensor>()>& fn);
  /// For outputs of a forward that did not run through DDP (a pipeline stage's micro-batches):
  /// makes it a DDP step — the step's checks (uneven inputs, rank 0's buffers for the next
  /// forward) and the gradient hooks armed for the backward of `outputs`, which must follow.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  /// Within the returned scope, backward accumulates gradients locally without communicating
  /// (gradient accumulation); the first backward after it averages everything accumulated.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }

  /// Called by a rank that has no more batches (see "Uneven inputs"), and by every rank at the
  /// end of an epoch or of training. Returns when every rank has joined. kFail: throws on every
  /// rank when others are still stepping; kJoin: shadows their steps until they join too.
  void join();

  /// Compares a checksum of every parameter and buffer across ranks; throws an Error naming the
  /// first tensor that differs and the ranks that disagree.
  void check_replicas();

  /// Sets every bucket (and so every gradient viewing it) to zero; cheaper than
  /// optimizer.zero_grad(), which drops the views and costs a copy on the next backward.
  void zero_grad();

  const std::vector<std::vector<size_t>>& buckets() const;
  const std::vector<std::string>& parameter_names() const;
  torch::nn::Module& module() { return *module_; }
  const Dist& dist() const { return dist_; }
  /// True when the gradient buckets and flags go through shared memory (DDPOptions::
  /// shared_memory, every rank on this machine, Gloo, float32 CPU buckets).
  bool uses_shared_memory() const;
  /// How float32 CPU buckets are summed: "gloo" or "nccl" (the backend), "shared memory" (one
  /// machine), or "hierarchical (M machines)" (Note [Hierarchical reduce] in
  /// src/dist/collectives.cpp).
  std::string reduce_path() const;

  struct Reducer;  // Note [Reducer] in src/ddp/reducer.cpp

 private:
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);
  void sync_after_join(const std::vector<int32_t>& before);

  std::shared_ptr<torch::nn::Module> module_;
  std::function<at::Tensor(const at::Tensor&)>
      call_;  // the module's forward, when its type has one
  Dist dist_;
  DDPOptions options_;
  std::unique_ptr<Reducer> reducer_;
  int64_t step_ = 0;
  std::vector<int32_t> last_flags_;  // the last uneven-input exchange (Note [Uneven inputs])
};

}  // namespace scaletrain
