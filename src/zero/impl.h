#pragma once
// ShardedDataParallel's state (internal). Note [Unit life cycle] in sharded_step.cpp.

#include <torch/csrc/autograd/function.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dist/collectives.h"
#include "scaletrain/zero.h"

namespace scaletrain {

/// A tensor over `flat`'s storage from element `offset` with `sizes` (contiguous), not an
/// autograd view (sharded.cpp).
at::Tensor zero_alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes);
/// "12.5 MB".
std::string zero_mb(int64_t bytes);

/// The parameters the units take (units.cpp): every one that requires grad and is not in
/// `ignored`, by name, in the module's order or, for a chain, block by block (with each block's
/// indices among them).
struct ZeroCollected {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<torch::nn::AnyModule> blocks;
  std::vector<std::vector<size_t>> block_params;
};
ZeroCollected collect_module(torch::nn::Module& m, const std::vector<at::Tensor>& ignored);
ZeroCollected collect_chain(torch::nn::SequentialImpl& chain,
                            const std::vector<at::Tensor>& ignored);

struct ShardedDataParallel::Impl {
  struct Unit {
    std::vector<size_t> params;  // indices into Impl::params, consecutive
    std::vector<size_t> blocks;  // stage 3: the chain's blocks it runs
    int64_t numel = 0, padded = 0, shard_numel = 0;
    at::Tensor full;       // [padded]: the parameters, back to back (stage 3: storage swapped)
    at::Tensor grad_full;  // [padded]: gradients (stage 1: always; 2, 3: during backward only)
    size_t pending = 0;    // parameters still without gradient in this backward
    bool reduced = false;  // its reduction is done since the last step
    bool carry = false;    // stage 1: the buffer holds a reduction's result (Note [Stage 1
                           // accumulation]) that the next backward must carry on from
    bool gathered = true;
    Pending gather_work;  // a gather in flight (stage 3 prefetch)
    at::Tensor gather_input;
    Pending reduce_work;
    at::Tensor reduce_input, reduce_output;
    int64_t shard_version = 0;  // the shard's version counter when last gathered (stages 1, 2)
    at::Tensor master_full;     // mixed precision: the master values, gathered for the module
  };

  Impl(ShardedDataParallel& owner, std::vector<at::Tensor> params, std::vector<std::string> names,
       std::vector<torch::nn::AnyModule> blocks,
       const std::vector<std::vector<size_t>>& block_params);
  ~Impl();

  // Construction, in order.
  void check_and_synchronise();
  void make_units(const std::vector<std::vector<size_t>>& block_params);
  void make_buffers();
  void open_groups();
  void install_hooks();
  void remove_hooks();
  void before_gradient(size_t param);
  std::string who() const;  // "rank r: ShardedDataParallel: ", for errors
  /// Each parameter's name, master dtype and sizes, one line each (checkpoints compare them).
  std::vector<std::string> described_params() const;

  // Gathering (stage 3: into freshly allocated storage; stages 1, 2: into the flat buffer).
  void start_gather(size_t u);
  void ensure_gathered(size_t u);
  void gather_sync(size_t u, at::Tensor out);
  void free_unit(size_t u);
  void gather_all();
  void gather_if_stepped();
  void allocate(size_t u);  // stage 3: full's storage, its bytes undefined

  // Mixed precision (Note [Mixed precision]): the module holds the master values or the compute
  // copies.
  void use_master_values();
  void use_compute_copies();
  at::Tensor compute_copy(const at::Tensor& shard) const;

  // Reduction, driven by the gradient hooks.
  void on_gradient(size_t i);
  void launch_ready();
  void launch_reduce(size_t u);
  void finish_reduce(size_t u);
  void check_reduced() const;
  at::Tensor forward_chain(at::Tensor x);

  ShardedDataParallel& owner;
  const Dist& dist;
  const ShardOptions& opts;
  int rank, world;
  // Mixed precision: the shards' dtype (the parameters' at construction) and the module's; equal
  // without param_dtype. `master_view`: the module's parameters alias the master values.
  at::ScalarType master_dtype = at::kFloat, compute_dtype = at::kFloat;
  bool mixed = false, master_view = false;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<size_t> unit_of;     // parameter -> unit
  std::vector<int64_t> offset_of;  // parameter -> its first element in its unit
  std::vector<bool> arrived;       // parameter got its gradient in this backward
  std::vector<Unit> units;
  std::vector<torch::nn::AnyModule> blocks;        // stage 3 (and any chain): the chain's blocks
  size_t next_reduce = 0;                          // units are reduced last to first, in order
  std::vector<size_t> in_flight;                   // launched, not finished
  std::optional<Dist> gather_group, reduce_group;  // none for a world of one
  // The same-machine path for float32 CPU units (null where any rank cannot map the segment).
  std::unique_ptr<Collectives> gather_shm, reduce_shm;
  bool shm(const std::unique_ptr<Collectives>& c, const at::Tensor& t) const {
    return c && t.is_cpu() && t.scalar_type() == at::kFloat;
  }
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks;
  // Pre-hooks cannot be removed from a node: they hold a weak pointer to this and do nothing
  // once it is gone.
  std::shared_ptr<Impl*> self = std::make_shared<Impl*>(this);
  int instance = 0;
};

}  // namespace scaletrain
