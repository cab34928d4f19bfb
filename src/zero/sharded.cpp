// ShardedDataParallel (zero.h): its units made, its hooks, and the public class. The units' life
// in each step (gather, reduce, mixed precision) is in sharded_step.cpp, Note [Unit life cycle].

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
at::Tensor zero_alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  auto t = at::empty({0}, flat.options());
  t.set_(flat.storage(), offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

std::string zero_mb(int64_t bytes) {
  return c10::str(static_cast<double>(bytes) / (1 << 20), " MB");
}

namespace {}  // namespace

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
  if (mixed && !opts.ignored_parameters.empty()) {
    throw UsageError(who() + "ignored_parameters with param_dtype " + c10::toString(compute_dtype) +
                     ": they would not compute in it; leave param_dtype unset, or ignore none");
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
          names[unit.params.back()] + ") gathers " + zero_mb(unit.padded * elem) +
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
      p.set_data(zero_alias(unit.full, offset_of[i], p.sizes()));
      if (opts.stage == 1) p.mutable_grad() = zero_alias(unit.grad_full, offset_of[i], p.sizes());
    }
    if (mixed) unit.full.copy_(master);
    const int64_t s = unit.shard_numel;
    // Stages 1 and 2 step the module's own buffer in place, unless it holds compute copies.
    at::Tensor shard = opts.stage == 3 || mixed ? master.narrow(0, rank * s, s).clone()
                                                : zero_alias(unit.full, rank * s, {s});
    shard.requires_grad_(true);
    if (opts.stage == 1 && !mixed) shard.mutable_grad() = zero_alias(unit.grad_full, rank * s, {s});
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

ShardedDataParallel::ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, Dist dist,
                                         ShardOptions options)
    : module_(std::move(module)), dist_(std::move(dist)), options_(options) {
  if (!module_) throw UsageError("ShardedDataParallel: the module is null");
  require_joined(dist_, "ShardedDataParallel");
  if (auto chain = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module_)) {
    auto c = collect_chain(*chain, options_.ignored_parameters);
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
  auto c = collect_module(*module_, options_.ignored_parameters);
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
