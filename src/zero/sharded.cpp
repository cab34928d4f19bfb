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

#include "dist/model_sync.h"
#include "scaletrain/error.h"
#include "zero/impl.h"
#include "zero/optimizer_state.h"

namespace scaletrain {
namespace {

// A tensor over `storage` from element `offset` with `sizes` (contiguous), not an autograd view.
at::Tensor alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  auto t = at::empty({0}, flat.options());
  t.set_(flat.storage(), offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

std::string mb(int64_t bytes) { return c10::str(static_cast<double>(bytes) / (1 << 20), " MB"); }

struct Collected {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<torch::nn::AnyModule> blocks;
  std::vector<std::vector<size_t>> block_params;
};

Collected collect_module(torch::nn::Module& m) {
  Collected c;
  for (auto& item : m.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    c.names.push_back(item.key());
    c.params.push_back(item.value());
  }
  return c;
}

// Parameters in block order; a parameter two blocks share cannot live in two units.
Collected collect_chain(torch::nn::SequentialImpl& chain) {
  Collected c;
  std::map<const void*, std::string> seen;
  auto children = chain.named_children();
  size_t b = 0;
  for (auto& any : chain) {
    c.blocks.push_back(any);
    const std::string& block = children[b].key();
    std::vector<size_t> mine;
    for (auto& item : children[b].value()->named_parameters(/*recurse=*/true)) {
      if (!item.value().requires_grad()) continue;
      const auto name = block + "." + item.key();
      auto [it, fresh] = seen.emplace(item.value().unsafeGetTensorImpl(), name);
      if (!fresh) {
        throw UsageError("ShardedDataParallel: parameter '" + name + "' is also '" + it->second +
                         "' of another block; a parameter shared by blocks (tied weights) must "
                         "live in one block");
      }
      mine.push_back(c.params.size());
      c.names.push_back(name);
      c.params.push_back(item.value());
    }
    c.block_params.push_back(std::move(mine));
    ++b;
  }
  return c;
}

}  // namespace

ShardedDataParallel::Impl::Impl(ShardedDataParallel& o, std::vector<at::Tensor> ps,
                                std::vector<std::string> ns, std::vector<torch::nn::AnyModule> bs,
                                const std::vector<std::vector<size_t>>& block_params)
    : owner(o),
      dist(o.dist_),
      opts(o.options_),
      rank(o.dist_.rank()),
      world(o.dist_.size()),
      params(std::move(ps)),
      names(std::move(ns)),
      blocks(std::move(bs)) {
  check_and_synchronise();
  make_units(block_params);
  make_buffers();
  open_groups();
  install_hooks();
}

std::string ShardedDataParallel::Impl::who() const {
  return "rank " + std::to_string(rank) + ": ShardedDataParallel: ";
}

// The options, one dtype and device, the same model on every rank; then rank 0's values.
void ShardedDataParallel::Impl::check_and_synchronise() {
  if (opts.stage < 1 || opts.stage > 3) {
    throw UsageError(who() + "stage " + std::to_string(opts.stage) +
                     " does not exist; use 1 (optimizer state), 2 (+ gradients) or 3 (+ "
                     "parameters)");
  }
  if (params.empty()) throw UsageError(who() + "the module has no parameter that requires grad");
  std::vector<std::string> described;
  for (size_t i = 0; i < params.size(); ++i) {
    described.push_back(describe_param(names[i], params[i]));
    if (params[i].scalar_type() != params[0].scalar_type() ||
        params[i].device() != params[0].device()) {
      throw UsageError(who() + "parameter '" + names[i] + "' is " + described.back() + " on " +
                       params[i].device().str() + ", parameter '" + names[0] + "' " +
                       c10::toString(params[0].scalar_type()) + " on " + params[0].device().str() +
                       "; every parameter needs one dtype and device");
    }
  }
  master_dtype = compute_dtype = params[0].scalar_type();
  for (auto [what, dtype] :
       {std::pair{"param_dtype", opts.param_dtype}, std::pair{"reduce_dtype", opts.reduce_dtype},
        std::pair{"buffer_dtype", opts.buffer_dtype}}) {
    if (dtype && !at::isFloatingType(*dtype)) {
      throw UsageError(who() + what + " = " + c10::toString(*dtype) +
                       " is not a floating-point dtype; use at::kBFloat16, at::kHalf or "
                       "at::kFloat");
    }
  }
  if (opts.param_dtype) {
    if (!at::isFloatingType(master_dtype)) {
      throw UsageError(who() + "param_dtype needs floating-point parameters; parameter '" +
                       names[0] + "' is " + c10::toString(master_dtype));
    }
    compute_dtype = *opts.param_dtype;
    mixed = compute_dtype != master_dtype;
  }
  if (opts.buffer_dtype && !mixed) {
    throw UsageError(who() + "buffer_dtype goes with a param_dtype other than the parameters' " +
                     c10::toString(master_dtype) +
                     " (buffers in another dtype than their layer's weights break batch norm)");
  }
  instance =
      static_cast<int>(dist.store_add("scaletrain/zero/instances/" + std::to_string(rank), 1));
  verify_same_model(dist, described, "zero", instance);
  broadcast_coalesced(dist, params, "the parameters");
  auto buffers = owner.module_->buffers();
  if (!buffers.empty()) broadcast_coalesced(dist, buffers, "the buffers");
  at::NoGradGuard no_grad;
  if (opts.buffer_dtype) {
    for (auto& b : buffers) {
      if (at::isFloatingType(b.scalar_type())) b.set_data(b.to(*opts.buffer_dtype));
    }
  }
  if (mixed) {  // frozen parameters are not sharded, but compute with the others
    for (auto& p : owner.module_->parameters()) {
      if (!p.requires_grad() && at::isFloatingType(p.scalar_type())) {
        p.set_data(p.to(compute_dtype));
      }
    }
  }
}

// The plan (Note [Units]): parameters (stages 1, 2) or blocks (stage 3) grouped by size.
void ShardedDataParallel::Impl::make_units(const std::vector<std::vector<size_t>>& block_params) {
  const auto elem = static_cast<int64_t>(c10::elementSize(compute_dtype));  // gathered bytes
  const auto cap = static_cast<int64_t>(opts.unit_cap_mb * (1 << 20)) / elem;
  std::vector<int64_t> groups;
  if (opts.stage == 3) {
    for (auto& bp : block_params) {
      int64_t n = 0;
      for (size_t i : bp) n += params[i].numel();
      groups.push_back(n);
    }
  } else {
    for (auto& p : params) groups.push_back(p.numel());
  }
  owner.plan_ = plan_units(groups, std::max<int64_t>(cap, 1), world);

  unit_of.resize(params.size());
  offset_of.resize(params.size());
  arrived.assign(params.size(), false);
  for (size_t u = 0; u < owner.plan_.size(); ++u) {
    const auto& r = owner.plan_[u];
    Unit unit;
    unit.numel = r.numel;
    unit.padded = r.padded;
    unit.shard_numel = r.padded / world;
    for (size_t g = r.first; g < r.first + r.count; ++g) {
      if (opts.stage == 3) {
        unit.blocks.push_back(g);
        for (size_t i : block_params[g]) unit.params.push_back(i);
      } else {
        unit.params.push_back(g);
      }
    }
    if (opts.unit_memory_budget_mb > 0 &&
        unit.padded * elem > opts.unit_memory_budget_mb * (1 << 20)) {
      throw UsageError(
          who() + "unit " + std::to_string(u) + " (" + names[unit.params.front()] + " .. " +
          names[unit.params.back()] + ") gathers " + mb(unit.padded * elem) +
          ", over unit_memory_budget_mb = " + std::to_string(opts.unit_memory_budget_mb) +
          "; split its block into smaller ones, or raise the budget");
    }
    int64_t offset = 0;
    for (size_t i : unit.params) {
      unit_of[i] = u;
      offset_of[i] = offset;
      offset += params[i].numel();
    }
    unit.pending = unit.params.size();
    units.push_back(std::move(unit));
  }
}

// Flat buffers; the module's parameters become aliases into them; the shards.
void ShardedDataParallel::Impl::make_buffers() {
  at::NoGradGuard no_grad;
  // (Taken before the loop turns the module's parameters into compute copies.)
  const auto options = params[0].options().dtype(master_dtype);
  const auto compute = options.dtype(compute_dtype);
  for (auto& unit : units) {
    // The master values, flat; without mixed precision they are the module's buffer itself.
    auto master = at::zeros({unit.padded}, options);
    unit.full = mixed ? at::empty({unit.padded}, compute) : master;
    if (opts.stage == 1) unit.grad_full = at::zeros({unit.padded}, compute);
    for (size_t i : unit.params) {
      auto& p = params[i];
      master.narrow(0, offset_of[i], p.numel()).copy_(p.detach().reshape({-1}));
      p.set_data(alias(unit.full, offset_of[i], p.sizes()));
      if (opts.stage == 1) p.mutable_grad() = alias(unit.grad_full, offset_of[i], p.sizes());
    }
    if (mixed) unit.full.copy_(master);
    const int64_t s = unit.shard_numel;
    // Stages 1 and 2 step the module's own buffer in place, unless it holds compute copies.
    at::Tensor shard = opts.stage == 3 || mixed ? master.narrow(0, rank * s, s).clone()
                                                : alias(unit.full, rank * s, {s});
    shard.requires_grad_(true);
    if (opts.stage == 1 && !mixed) shard.mutable_grad() = alias(unit.grad_full, rank * s, {s});
    unit.shard_version = shard._version();
    owner.shards_.push_back(shard);
  }
  if (opts.stage == 3) {
    for (size_t u = 0; u < units.size(); ++u) free_unit(u);
  }
}

// Gathers and reductions each on a process group of their own (Note [Unit life cycle]).
void ShardedDataParallel::Impl::open_groups() {
  if (world == 1) return;
  const auto prefix = "scaletrain/zero/" + std::to_string(instance) + "/";
  gather_group = clone_group(dist, prefix + "gather");
  reduce_group = clone_group(dist, prefix + "reduce");
  if (!opts.shared_memory) return;
  // Each segment falls back on its own group, so the two never interleave.
  gather_shm = make_collectives(*gather_group, {}, prefix + "gather-shm");
  reduce_shm = make_collectives(*reduce_group, {}, prefix + "reduce-shm");
  if (!gather_shm->shared_memory() || !reduce_shm->shared_memory()) {
    gather_shm.reset();
    reduce_shm.reset();
  }
}

namespace {

struct LambdaPreHook : torch::autograd::FunctionPreHook {
  explicit LambdaPreHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    fn_();
    return grads;
  }
  std::function<void()> fn_;
};

}  // namespace

void ShardedDataParallel::Impl::remove_hooks() {
  for (auto& [acc, key] : hooks) acc->del_post_hook(key);
  hooks.clear();
}

void ShardedDataParallel::Impl::install_hooks() {
  next_reduce = units.size();
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          on_gradient(i);
          return outputs;
        }));
    hooks.emplace_back(acc, key);
    if (opts.stage == 1 && !mixed) {
      std::weak_ptr<Impl*> weak = self;
      acc->add_pre_hook(std::make_unique<LambdaPreHook>([weak, i] {
        if (auto alive = weak.lock()) (*alive)->before_gradient(i);
      }));
    }
  }
}

// Note [Stage 1 accumulation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Stage 1 keeps the full gradient buffer: the module's .grad are aliases into it, so autograd
// accumulates there without a copy, and this rank's shard's .grad is the slice it owns. A
// reduction (every backward's) leaves the owned slice holding the average S/N of the sum S of
// what every rank accumulated, and the rest of the buffer zero. Another backward before the
// step (gradient accumulation) must sum to S plus its own gradients: before the first gradient
// of a unit reaches the buffer (a pre-hook on its accumulator), the owned slice is multiplied by
// N back to S — or, when the caller has let go of the shard's gradient (zero_grad), the buffer
// starts from zero. The sum through shared memory then runs in place on the buffer itself.
void ShardedDataParallel::Impl::before_gradient(size_t i) {
  auto& unit = units[unit_of[i]];
  if (!unit.carry) return;
  unit.carry = false;
  at::NoGradGuard no_grad;
  const int64_t s = unit.shard_numel;
  auto owned = unit.grad_full.narrow(0, rank * s, s);
  const auto& sg = owner.shards_[unit_of[i]].grad();
  if (sg.defined() && sg.data_ptr() == owned.data_ptr()) {
    owned.mul_(world);
  } else {
    unit.grad_full.zero_();
  }
}

ShardedDataParallel::Impl::~Impl() {
  remove_hooks();
  for (auto& u : units) {
    try {
      u.gather_work.wait();
      u.reduce_work.wait();
    } catch (const std::exception&) {  // a destructor reports nothing; the next collective will
    }
  }
}

// ---- Gathering ---------------------------------------------------------------------------

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
          mb(unit.padded * unit.full.element_size()) + ")");
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
    // All-gather as a sum, in the master dtype: every rank contributes its shard in its own
    // place and zeros elsewhere, x + 0 is exact, so every rank ends with every shard's bits (and
    // the compute copies are those bits rounded, as a cast before the gather would give).
    const bool direct = out.scalar_type() == shard.scalar_type();
    auto sum = direct ? out : at::empty({unit.padded}, shard.options());
    const auto mine = shard.storage().is_alias_of(sum.storage()) ? shard.clone() : shard;
    sum.zero_();
    sum.narrow(0, rank * unit.shard_numel, unit.shard_numel).copy_(mine);
    gather_shm->all_reduce_sum(sum, what).wait();
    if (!direct) out.copy_(sum);
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
      params[i].set_data(alias(unit.master_full, offset_of[i], params[i].sizes()));
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
      params[i].set_data(alias(unit.full, offset_of[i], params[i].sizes()));
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
    auto view = alias(unit.grad_full, offset, p.sizes());
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
    auto view = alias(unit.grad_full, rank * s, {s});
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

ShardedDataParallel::ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, Dist dist,
                                         ShardOptions options)
    : module_(std::move(module)), dist_(std::move(dist)), options_(options) {
  if (!module_) throw UsageError("ShardedDataParallel: the module is null");
  require_joined(dist_, "ShardedDataParallel");
  if (auto chain = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module_)) {
    auto c = collect_chain(*chain);
    impl_ = std::make_unique<Impl>(*this, std::move(c.params), std::move(c.names),
                                   std::move(c.blocks), c.block_params);
    return;
  }
  if (options_.stage == 3) {
    throw UsageError(
        "ShardedDataParallel: stage 3 gathers the model one unit of blocks at a time, so it "
        "needs the model as a chain: a torch::nn::Sequential (of scaletrain::Block, blocks.h); "
        "or use stage 1 or 2 for any module");
  }
  auto c = collect_module(*module_);
  impl_ = std::make_unique<Impl>(*this, std::move(c.params), std::move(c.names),
                                 std::vector<torch::nn::AnyModule>{},
                                 std::vector<std::vector<size_t>>{});
}

ShardedDataParallel::ShardedDataParallel(torch::nn::Sequential chain, Dist dist,
                                         ShardOptions options)
    : ShardedDataParallel(std::static_pointer_cast<torch::nn::Module>(chain.ptr()), std::move(dist),
                          options) {}

ShardedDataParallel::~ShardedDataParallel() = default;

at::Tensor ShardedDataParallel::forward(const at::Tensor& input) {
  if (impl_->blocks.empty()) {
    throw UsageError(
        "ShardedDataParallel::forward(x) runs a chain (a model given as torch::nn::Sequential); "
        "for another module call forward([&] { return model->forward(x); })");
  }
  return impl_->forward_chain(input);
}

at::Tensor ShardedDataParallel::forward(const std::function<at::Tensor()>& fn) {
  if (options_.stage == 3) {
    throw UsageError(
        "ShardedDataParallel::forward(fn): stage 3 runs the chain itself; call "
        "forward(x)");
  }
  impl_->use_compute_copies();
  impl_->gather_if_stepped();
  return fn();
}

void ShardedDataParallel::step(torch::optim::Optimizer& opt) {
  impl_->check_reduced();
  opt.step();
  impl_->use_compute_copies();
  for (auto& unit : impl_->units) unit.reduced = false;
  std::fill(impl_->arrived.begin(), impl_->arrived.end(), false);
  if (options_.stage < 3) {
    impl_->gather_all();
  } else {
    reshard();  // gathered values are stale now
  }
}

void ShardedDataParallel::scatter_full_parameters() {
  at::NoGradGuard no_grad;
  if (impl_->mixed) {
    if (!impl_->master_view) {
      throw UsageError(
          "ShardedDataParallel::scatter_full_parameters: the module holds the compute copies "
          "(param_dtype); call gather_full_parameters() before changing the module's "
          "parameters");
    }
    for (size_t u = 0; u < impl_->units.size(); ++u) {
      auto& unit = impl_->units[u];
      shards_[u].detach().copy_(
          unit.master_full.narrow(0, impl_->rank * unit.shard_numel, unit.shard_numel));
    }
    return;
  }
  if (options_.stage < 3) return;  // the shards are slices of the module's own buffers
  for (size_t u = 0; u < impl_->units.size(); ++u) {
    auto& unit = impl_->units[u];
    if (!unit.gathered) {
      throw UsageError("ShardedDataParallel::scatter_full_parameters: unit " + std::to_string(u) +
                       " is not gathered; call gather_full_parameters() before changing the "
                       "module's parameters");
    }
    shards_[u].detach().copy_(
        unit.full.narrow(0, impl_->rank * unit.shard_numel, unit.shard_numel));
  }
}

void ShardedDataParallel::gather_full_parameters() {
  if (impl_->mixed) {
    impl_->use_master_values();
    return;
  }
  if (options_.stage < 3) {
    impl_->gather_if_stepped();
    return;
  }
  for (size_t u = 0; u < impl_->units.size(); ++u) impl_->ensure_gathered(u);
}

void ShardedDataParallel::reshard() {
  impl_->use_compute_copies();
  if (options_.stage < 3) return;
  for (size_t u = 0; u < impl_->units.size(); ++u) impl_->free_unit(u);
}

std::vector<std::vector<size_t>> ShardedDataParallel::unit_parameters() const {
  std::vector<std::vector<size_t>> out;
  for (auto& unit : impl_->units) out.push_back(unit.params);
  return out;
}

namespace {

// Bytes of the storages of `module`'s parameters and `more_params` (and of their gradients, and
// `more_grads`), and of `opt`'s state for its parameters, each storage counted once.
ShardMemory count_state(const torch::nn::Module& module, const std::vector<at::Tensor>& more_params,
                        const std::vector<at::Tensor>& more_grads,
                        const torch::optim::Optimizer* opt) {
  ShardMemory m;
  std::set<const void*> seen;
  auto count = [&](const at::Tensor& t, int64_t& into) {
    if (!t.defined() || !t.has_storage()) return;
    auto* s = t.storage().unsafeGetStorageImpl();
    if (seen.insert(s).second) into += static_cast<int64_t>(s->nbytes());
  };
  auto params = module.parameters();
  params.insert(params.end(), more_params.begin(), more_params.end());
  for (auto& p : params) count(p, m.parameters);
  for (auto& p : params) count(p.grad(), m.gradients);
  for (auto& g : more_grads) count(g, m.gradients);
  if (opt) {
    for (auto& group : opt->param_groups()) {
      for (auto& p : group.params()) {
        if (auto st = param_state(*opt, p)) {
          for (auto& [name, t] : st->tensors) count(t, m.optimizer);
        }
      }
    }
  }
  return m;
}

}  // namespace

ShardMemory model_state_memory(const torch::nn::Module& module,
                               const torch::optim::Optimizer* opt) {
  return count_state(module, {}, {}, opt);
}

ShardMemory ShardedDataParallel::memory(const torch::optim::Optimizer* opt) const {
  std::vector<at::Tensor> grad_buffers;
  for (auto& unit : impl_->units) grad_buffers.push_back(unit.grad_full);
  return count_state(*module_, shards_, grad_buffers, opt);
}

}  // namespace scaletrain
