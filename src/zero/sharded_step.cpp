// Note [Unit life cycle]
// ~~~~~~~~~~~~~~~~~~~~~~
// Each unit (Note [Units] in units.cpp) keeps its parameters flat in one buffer, `full`; the
// module's parameters are aliases into it (same storage, their own TensorImpl, so autograd,
// the optimizer and state dicts see ordinary leaf tensors). This rank's shard of it is the leaf
// the optimizer steps.
//
//   stage 1, 2   full lives always; the shard is an alias of its slice [r·S, (r+1)·S), so the
//                optimizer updates it in place; after the step the other ranks' slices are
//                all-gathered into it (step(), or the next forward when it sees the shard's
//                version counter moved). With param_dtype (Note [Mixed precision]) the shard
//                has a storage of its own, and the gather fills full with compute copies.
//   stage 3      full's storage is allocated only while the unit computes: the shard has a
//                storage of its own, and the buffer's bytes are swapped in and out of the one
//                StorageImpl every alias shares (so the tensors autograd saved in forward see
//                the gathered values again in backward).
//
// Gradients. A post-hook on each parameter's gradient accumulator moves the fresh gradient into
// the unit's flat gradient buffer `grad_full` (stage 1: .grad is an alias into it, nothing
// moves). When every parameter of a unit has its gradient, the unit is ready; ready units are
// reduce-scattered last to first, in index order on every rank (as DDP launches its buckets), on
// a process group of their own, at most two in flight. The result, divided by N, is this rank's
// shard's .grad (stage 1: written into the alias of grad_full's slice; stages 2, 3: accumulated
// into a [S] tensor, and grad_full is freed).
//
// Stage 3, one unit u of U, in time (a row per rank's thread; = computes, ~ communicates):
//
//   forward    gather u ~~~~| run u's blocks ==== | free u     (prefetch: gather u+1 ~~~~ here)
//   backward   (hook on u's output) gather u ~~~| u's backward ==== | reduce-scatter u ~~~ | free u
//
// The last unit stays gathered from its forward to its backward (it is needed at once), and
// the gathers run on a process group of their own, so a prefetch never waits behind a
// reduction. Every rank issues the same collectives in the same order: gathers follow the chain
// (0..U−1 forward, U−1..0 backward), reductions go last to first.

#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/container/sequential.h>

#include <set>

#include "checkpoint/optimizer_state.h"
#include "dist/model_sync.h"
#include "scaletrain/error.h"
#include "zero/impl.h"

namespace scaletrain {

void ShardedDataParallel::Impl::allocate(size_t u) {
  auto& unit = units[u];
  auto* storage = unit.full.storage().unsafeGetStorageImpl();
  const auto bytes = static_cast<size_t>(unit.padded) * unit.full.element_size();
  if (storage->nbytes() != bytes) {
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
    storage->set_nbytes(bytes);
  }
}

at::Tensor ShardedDataParallel::Impl::compute_copy(const at::Tensor& shard) const {
  return mixed ? shard.detach().to(compute_dtype) : shard.detach();
}

void ShardedDataParallel::Impl::start_gather(size_t u) {
  auto& unit = units[u];
  if (unit.gathered || unit.gather_work) return;
  allocate(u);
  const auto& shard = owner.shards_[u];
  if (!gather_group || shm(gather_shm, shard)) {
    gather_sync(u, unit.full);
    unit.gathered = true;
    return;
  }
  unit.gather_input = compute_copy(shard);
  unit.gather_work = gather_group->all_gather_into_tensor_async(
      unit.full, unit.gather_input,
      "all-gather of unit " + std::to_string(u) + "'s parameters (" +
          zero_mb(unit.padded * unit.full.element_size()) + ")");
}

// Every rank's current shard of unit u into `out` ([padded]; the compute copies or the master
// values), before returning.
void ShardedDataParallel::Impl::gather_sync(size_t u, at::Tensor out) {
  auto& unit = units[u];
  at::NoGradGuard no_grad;
  const auto shard = owner.shards_[u].detach();
  if (!gather_group) {  // a world of one: the shard is the whole unit
    out.copy_(shard);
    return;
  }
  const auto what = "all-gather of unit " + std::to_string(u) + "'s parameters";
  if (shm(gather_shm, shard)) {
    // Through the segment in the master dtype (float32): every rank ends with every shard's
    // bits, and the compute copies are those bits rounded, as a cast before the gather gives.
    const bool direct = out.scalar_type() == shard.scalar_type();
    auto all = direct ? out : at::empty({unit.padded}, shard.options());
    const auto mine = shard.storage().is_alias_of(all.storage()) ? shard.clone() : shard;
    gather_shm->all_gather_into(all, mine.contiguous(), what);
    if (!direct) out.copy_(all);
    return;
  }
  auto input = shard.to(out.scalar_type());
  if (input.storage().is_alias_of(out.storage())) input = input.clone();
  gather_group->all_gather_into_tensor_async(out, input, what).wait();
}

void ShardedDataParallel::Impl::ensure_gathered(size_t u) {
  start_gather(u);
  auto& unit = units[u];
  if (unit.gather_work) {
    unit.gather_work.wait();
    unit.gather_input.reset();
  }
  unit.gathered = true;
}

void ShardedDataParallel::Impl::free_unit(size_t u) {
  auto& unit = units[u];
  if (unit.gather_work) ensure_gathered(u);  // never free under a collective
  auto* storage = unit.full.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, unit.full.device()));
  storage->set_nbytes(0);
  unit.gathered = false;
}

// Stages 1 and 2: every unit's full buffer from the ranks' shards.
void ShardedDataParallel::Impl::gather_all() {
  use_compute_copies();
  for (size_t u = 0; u < units.size(); ++u) {
    if (gather_group || mixed) gather_sync(u, units[u].full);
    units[u].shard_version = owner.shards_[u]._version();
  }
  if (opts.stage == 1) {
    at::NoGradGuard no_grad;
    for (auto& unit : units) {
      unit.grad_full.zero_();  // the step consumed them
      unit.carry = false;
    }
  }
}

void ShardedDataParallel::Impl::gather_if_stepped() {
  for (size_t u = 0; u < units.size(); ++u) {
    if (owner.shards_[u]._version() != units[u].shard_version) {
      gather_all();
      return;
    }
  }
}

// ---- Mixed precision ---------------------------------------------------------------------

// Note [Mixed precision]
// ~~~~~~~~~~~~~~~~~~~~~~
// With ShardOptions::param_dtype (say bf16 over fp32 parameters), as FSDP's MixedPrecisionPolicy:
//
//   shards       fp32: the optimizer's master weights, its state, and the shards' .grad
//   unit.full    bf16: what the gathers fill (cast before the wire, or after a shared-memory
//                gather, which sums in fp32: the same bits), what the module's parameters alias
//   gradients    arrive in bf16 (grad_full), are reduced in reduce_dtype (unset: bf16), then
//                divided by N in fp32 and accumulated into the shard's .grad
//
// So stages 1 and 2 keep the shard in a storage of its own, as stage 3 does, and stage 1's
// buffer of full gradients is in bf16 and zeroed after each reduction (no carry: the shard's
// .grad is not a slice of it). Bytes per rank with Adam (K = 12 in the ZeRO paper's terms, plus
// the fp32 gradient shard the paper's optimizer does not keep):
//   stage 1  2Ψ + 2Ψ + 16Ψ/N     stage 2  2Ψ + 16Ψ/N     stage 3  16Ψ/N (+ units gathered)
//
// The module's parameters cannot be fp32 and bf16 at once, and changing a parameter's dtype
// (set_data) drops its gradient accumulator, which the reduction's hooks sit on. The module
// holds the compute copies; gather_full_parameters() points them at the master values,
// gathered in fp32 (what a checkpoint must save and load, losslessly), and the next forward,
// step() or reshard() points them back at the compute copies and hooks the new accumulators.

void ShardedDataParallel::Impl::use_master_values() {
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units.size(); ++u) {
    auto& unit = units[u];
    unit.master_full = at::empty({unit.padded}, owner.shards_[u].options());
    gather_sync(u, unit.master_full);
    for (size_t i : unit.params) {
      params[i].set_data(zero_alias(unit.master_full, offset_of[i], params[i].sizes()));
    }
    if (opts.stage == 3 && unit.gathered) free_unit(u);
  }
  master_view = true;
}

void ShardedDataParallel::Impl::use_compute_copies() {
  if (!master_view) return;
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units.size(); ++u) {
    auto& unit = units[u];
    if (opts.stage == 3) allocate(u);  // an alias needs the bytes it covers; freed again below
    for (size_t i : unit.params) {
      params[i].set_data(zero_alias(unit.full, offset_of[i], params[i].sizes()));
    }
    unit.master_full = at::Tensor();
    if (opts.stage == 3) free_unit(u);
  }
  master_view = false;
  remove_hooks();
  install_hooks();
}

// ---- Reduction ---------------------------------------------------------------------------

void ShardedDataParallel::Impl::on_gradient(size_t i) {
  arrived[i] = true;
  const size_t u = unit_of[i];
  auto& unit = units[u];
  auto& p = params[i];
  const int64_t offset = offset_of[i];
  auto& g = p.mutable_grad();
  if (opts.stage == 1) {
    auto view = zero_alias(unit.grad_full, offset, p.sizes());
    if (g.defined() && g.data_ptr() != view.data_ptr()) view.copy_(g);
    g = view;
  } else {
    if (!unit.grad_full.defined()) unit.grad_full = at::zeros({unit.padded}, p.options());
    unit.grad_full.narrow(0, offset, p.numel()).add_(g.reshape({-1}));
    g = at::Tensor();
  }
  if (unit.pending > 0 && --unit.pending == 0) launch_ready();
}

void ShardedDataParallel::Impl::launch_ready() {
  while (next_reduce > 0 && units[next_reduce - 1].pending == 0) {
    launch_reduce(next_reduce - 1);
    --next_reduce;
  }
  if (next_reduce == 0) {
    for (size_t u : in_flight) finish_reduce(u);
    in_flight.clear();
    next_reduce = units.size();
  }
}

void ShardedDataParallel::Impl::launch_reduce(size_t u) {
  auto& unit = units[u];
  unit.reduce_input = opts.reduce_dtype ? unit.grad_full.to(*opts.reduce_dtype) : unit.grad_full;
  if (reduce_group && shm(reduce_shm, unit.reduce_input)) {
    // In place, also stage 1's buffer (Note [Stage 1 accumulation]).
    const auto what = "reduce of unit " + std::to_string(u) + "'s gradients";
    reduce_shm->all_reduce_sum(unit.reduce_input, what).wait();
    unit.reduce_output = unit.reduce_input.narrow(0, rank * unit.shard_numel, unit.shard_numel);
  } else if (reduce_group) {
    unit.reduce_output = at::empty({unit.shard_numel}, unit.reduce_input.options());
    unit.reduce_work = reduce_group->reduce_scatter_tensor_async(
        unit.reduce_output, unit.reduce_input, ReduceOp::SUM,
        "reduce-scatter of unit " + std::to_string(u) + "'s gradients");
  } else {
    unit.reduce_output = unit.reduce_input;
  }
  in_flight.push_back(u);
  while (in_flight.size() > 2) {  // bounds the full gradients alive at once (stage 2)
    finish_reduce(in_flight.front());
    in_flight.erase(in_flight.begin());
  }
}

void ShardedDataParallel::Impl::finish_reduce(size_t u) {
  auto& unit = units[u];
  unit.reduce_work.wait();
  at::NoGradGuard no_grad;
  auto g = unit.reduce_output.to(master_dtype);
  if (world > 1) g.div_(world);
  auto& shard = owner.shards_[u];
  auto& sg = shard.mutable_grad();
  if (opts.stage == 1 && !mixed) {
    // The owned slice holds the average, the rest zero (Note [Stage 1 accumulation]).
    const int64_t s = unit.shard_numel;
    auto view = zero_alias(unit.grad_full, rank * s, {s});
    if (!sg.defined() || sg.data_ptr() != view.data_ptr()) sg = view;
    if (g.data_ptr() != view.data_ptr()) view.copy_(g);
    unit.grad_full.narrow(0, 0, rank * s).zero_();
    unit.grad_full.narrow(0, (rank + 1) * s, unit.padded - (rank + 1) * s).zero_();
    unit.carry = true;
  } else {
    if (!sg.defined()) {
      // Never keep the whole buffer alive through a view of it.
      sg = g.storage().is_alias_of(unit.grad_full.storage()) ||
                   g.storage().is_alias_of(unit.reduce_input.storage())
               ? g.clone()
               : g;
    } else {
      sg.add_(g);
    }
    if (opts.stage == 1) {
      unit.grad_full.zero_();  // stage 1 keeps the buffer; the next backward starts from zero
    } else {
      unit.grad_full = at::Tensor();
    }
  }
  unit.reduce_input = at::Tensor();
  unit.reduce_output = at::Tensor();
  unit.pending = unit.params.size();
  unit.reduced = true;
  if (opts.stage == 3) free_unit(u);
}

void ShardedDataParallel::Impl::check_reduced() const {
  std::string missing;
  bool any_missing = false;
  for (const auto& unit : units) {
    if (unit.reduced) continue;
    any_missing = true;
    for (size_t i : unit.params) {
      if (!arrived[i]) missing += (missing.empty() ? "" : ", ") + names[i];
    }
  }
  if (!any_missing) return;
  throw Error("rank " + std::to_string(rank) +
              ": ShardedDataParallel::step() before the gradients of every unit were reduced" +
              (missing.empty() ? std::string(" (no backward since the last step?)")
                               : "; no gradient reached: " + missing +
                                     ". Every backward must reach every parameter (freeze "
                                     "unused ones with requires_grad(false) before wrapping)"));
}

// ---- Forward -----------------------------------------------------------------------------

at::Tensor ShardedDataParallel::Impl::forward_chain(at::Tensor x) {
  use_compute_copies();
  if (mixed && at::isFloatingType(x.scalar_type())) x = x.to(compute_dtype);
  if (opts.stage < 3) {
    gather_if_stepped();
    for (auto& b : blocks) x = b.forward(x);
    return x;
  }
  for (size_t u = 0; u < units.size(); ++u) {
    ensure_gathered(u);
    if (opts.prefetch && u + 1 < units.size()) start_gather(u + 1);
    for (size_t b : units[u].blocks) x = blocks[b].forward(x);
    const bool grad = at::GradMode::is_enabled() && x.requires_grad();
    if (!grad || (u + 1 < units.size() && opts.reshard_after_forward)) free_unit(u);
    if (grad) {
      x.register_hook([this, u](const at::Tensor&) {
        ensure_gathered(u);
        if (opts.prefetch && u > 0) start_gather(u - 1);
      });
    }
  }
  return x;
}

// ---- The public class --------------------------------------------------------------------

}  // namespace scaletrain
