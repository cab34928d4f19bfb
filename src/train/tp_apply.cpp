// Note [Tensor parallelism applied first] in tp_apply.h.

#include "train/tp_apply.h"

#include "checkpoint/optimizer_state.h"

#include <algorithm>

#include "scaletrain/context_parallel.h"
#include "scaletrain/error.h"
#include "scaletrain/log.h"
#include "scaletrain/tensor_parallel.h"
#include "scaletrain/zero.h"
#include "tp/partial_sums.h"
#include "train/run_folder.h"

namespace scaletrain {

TpApplied::TpApplied(const TrainTask& task, const TrainerOptions& o, const Dist& world,
                     Model& whole, const at::Device& device)
    : world_(world),
      whole_(whole),
      degree_(std::max(o.tensor_parallel.size, 1)),
      device_(device),
      loss_(task.loss) {
  ep_degree_ = std::max(o.expert_parallel.size, 1);
  const ParallelDims dims = parallel_dims(o).resolve(world.size());
  if (split()) {  // "dp" here is dp x cp flattened: the ranks that average a gradient
    mesh_ = DeviceMesh({{"dp", dims.dp_cp()}, {"tp", dims.tp}}, world.size());
    groups_ = mesh_groups(world_, *mesh_, "tensor_parallel");
    build_split(task, o);
  }
  trained().module->to(device_);
  if (dims.cp > 1) apply_context_parallel(o, dims);
  moes_ = moe_layers(*trained().module);
  if (ep_degree_ > 1) apply_expert_parallel(dims, o.strategy);
}

// Note [Expert parallelism applied after context parallelism] in tp_apply.h.
void TpApplied::apply_expert_parallel(const ParallelDims& dims, Strategy strategy) {
  if (moes_.empty()) {
    throw UsageError("TrainerOptions::expert_parallel.size " + std::to_string(ep_degree_) +
                     ": the model '" + split_.name +
                     "' has no MoE layer (expert_parallel.h) to spread over ranks; train it with "
                     "expert_parallel.size 1, or build its feed-forward layers as MoE");
  }
  const DeviceMesh mesh({{"edp", dims.dp_cp() / ep_degree_}, {"ep", ep_degree_}, {"tp", dims.tp}},
                        world_.size());
  auto groups = mesh_groups(world_, mesh, "expert_parallel", {"ep", "edp"});
  ep_ = groups.at("ep");
  edp_ = groups.at("edp");
  for (MoEImpl* moe : moes_) moe->expert_parallel(&*ep_);
  if (strategy == Strategy::kFsdp && edp_->size() > 1) {
    const bool even = std::all_of(moes_.begin(), moes_.end(), [&](const MoEImpl* m) {
      return m->local_experts() % edp_->size() == 0;
    });
    if (even) {
      for (MoEImpl* moe : moes_) moe->shard_experts(&*edp_);
      experts_sharded_ = true;
    } else if (world_.rank() == 0) {
      log_line(LogLevel::kInfo,
               "fsdp keeps the experts whole on each of the " + std::to_string(edp_->size()) +
                   " ranks that share them: " + std::to_string(moes_.front()->local_experts()) +
                   " experts per ep rank do not shard evenly over " + std::to_string(edp_->size()) +
                   " (an expert count or ep degree that leaves a "
                   "multiple of them would)");
    }
  }
  for (const auto& m : split_.module->named_modules()) {
    auto* moe = dynamic_cast<MoEImpl*>(m.value().get());
    if (moe == nullptr) continue;
    for (const auto& p : moe->named_parameters(false)) {
      if (p.key() == "router") continue;
      expert_param_names_.push_back(m.key().empty() ? p.key() : m.key() + "." + p.key());
      expert_names_.insert(expert_param_names_.back());
      experts_.insert(p.value().unsafeGetTensorImpl());
      expert_params_.push_back(p.value());
    }
  }
  // Sequence parallelism: the experts' partial sums over tp are this step's (reduce below), not
  // the replicated parameters' deferred sum's, which a ZeRO strategy takes from its shards.
  const auto before = deferred_.size();
  deferred_.erase(std::remove_if(deferred_.begin(), deferred_.end(),
                                 [&](const at::Tensor& p) { return is_expert(p); }),
                  deferred_.end());
  experts_summed_over_tp_ = deferred_.size() != before;
}

void TpApplied::add_expert_states(const torch::optim::Optimizer& opt, NamedStates& states) const {
  for (size_t i = 0; i < expert_params_.size(); ++i) {
    if (auto st = param_state(opt, expert_params_[i])) states[expert_param_names_[i]] = *st;
  }
}

void TpApplied::set_expert_states(torch::optim::Optimizer& opt, const NamedStates& sliced) const {
  for (size_t i = 0; i < expert_params_.size(); ++i) {
    auto it = sliced.find(expert_param_names_[i]);
    if (it == sliced.end()) continue;  // never stepped
    ParamState st = it->second;
    for (auto& [kind, t] : st.tensors) t = t.to(expert_params_[i].device());
    set_param_state(opt, expert_params_[i], st);
  }
}

void TpApplied::set_aux_loss_scale(double weight) {
  for (MoEImpl* moe : moes_) moe->aux_loss_scale = weight;
}

void TpApplied::zero_expert_gradients() {
  for (auto& p : expert_params_) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

void TpApplied::reduce_expert_gradients() {
  if (expert_params_.empty()) return;
  std::vector<at::Tensor> grads;
  for (auto& p : expert_params_) {  // every expert has one: its rows' products, or zeros
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    grads.push_back(p.grad());
  }
  at::Tensor flat = flat_copy(grads, collective());
  // Sharded, their backward summed them over edp already (Note [Experts sharded over edp]).
  if (edp_->size() > 1 && !experts_sharded_) {
    edp_->all_reduce(flat, ReduceOp::SUM, "the experts' gradients");
  }
  if (experts_summed_over_tp_) tp().all_reduce(flat, ReduceOp::SUM, "the experts' partial sums");
  flat.div_(dp().size());  // DDP's average over dp x cp
  torch::NoGradGuard no_grad;
  copy_from_flat(flat, grads);
}

double TpApplied::expert_square_sum() const {
  if (expert_params_.empty()) return 0;
  double mine = 0;
  for (const auto& p : expert_params_) {
    if (p.grad().defined()) mine += p.grad().detach().to(at::kDouble).pow(2).sum().item<double>();
  }
  return sum_over(experts_sharded_ ? dp() : *ep_, mine, collective());
}

// Note [Context parallelism applied after tensor parallelism] in tp_apply.h.
void TpApplied::apply_context_parallel(const TrainerOptions& o, const ParallelDims& dims) {
  apply_context(
      o, mesh_groups(world_, dims.mesh({"dp", "cp", "tp"}), "context_parallel", {"cp"}).at("cp"));
}

void TpApplied::apply_context(const TrainerOptions& o, const Dist& cp) {
  Model& m = trained();
  if (!m.context_parallel) {
    throw UsageError("TrainerOptions::context_parallel.size " + std::to_string(cp.size()) +
                     ": the model '" + m.name +
                     "' has no attention to split over a sequence (its Model::context_parallel "
                     "is null); train it with TrainerOptions::context_parallel.size 1, or give "
                     "its Model a context_parallel hook (context_parallel.h)");
  }
  cp_degree_ = cp.size();
  const ContextSplit split{cp.size(), cp.rank(), o.context_parallel.load_balanced};
  m.context_parallel(&cp, split);
  context_.set(&cp, split);
  context_off_ = m.context_parallel;
}

TpApplied::~TpApplied() {
  if (context_off_) context_off_(nullptr, ContextSplit{});  // the task's model whole again
}

int TpApplied::data_rank() const {
  return (mesh_ ? mesh_->coordinate(world_.rank(), "dp") : world_.rank()) / cp_degree_;
}

int TpApplied::data_replicas() const {
  return (mesh_ ? mesh_->size("dp") : world_.size()) / cp_degree_;
}

TpApplied::TpApplied(const TrainTask& task, const TrainerOptions& o, const Dist& world,
                     Model& whole, const at::Device& device, DeviceMesh mesh,
                     std::map<std::string, Dist> groups)
    : world_(world),
      whole_(whole),
      degree_(std::max(o.tensor_parallel.size, 1)),
      mesh_(std::move(mesh)),
      groups_(std::move(groups)),
      device_(device),
      loss_(task.loss) {
  if (split()) build_split(task, o);
  moes_ = moe_layers(*trained().module);
}

void TpApplied::build_split(const TrainTask& task, const TrainerOptions& o) {
  split_ =
      split_build(task, whole_, world_, tp(), o.tensor_parallel.sequence_parallel, collective());
  replicated_ = replicated_set(*split_.module);
  if (o.tensor_parallel.sequence_parallel) {  // summed once per step, in one all-reduce
    deferred_ = replicated_parameters(*split_.module);
    defer_partial_sums(deferred_);
  }
  if (degree_ > 1 && split_.parallel_loss) loss_ = split_.parallel_loss;
}

at::Device TpApplied::collective() const {
  return world_.backend_name == "nccl" ? device_ : at::Device(at::kCPU);
}

at::Tensor TpApplied::whole_outputs(const at::Tensor& out) const {
  return context_.gather(outputs_split() ? gather_from_region(out, tp(), -1) : out, 1);
}

std::optional<TrainStrategy::SplitOutputs> TpApplied::split_outputs(const at::Tensor& out) const {
  if (!evaluates_split()) return std::nullopt;
  return TrainStrategy::SplitOutputs{out, ClassSlice{&tp(), tp().rank() * out.size(-1)}};
}

void TpApplied::after_last_backward() {
  if (!split()) return;  // the whole model's own after_backward runs in its forward's place
  reduce_expert_gradients();
  if (!deferred_.empty()) sum_deferred_partial_gradients(deferred_, tp());
  if (split_.after_backward) split_.after_backward();
}

// Sequence parallelism under ZeRO: the replicated parameters' parts of this rank's gradient
// shards, summed over tp. The tp ranks' split models have the same shapes, so their units and
// shards line up part for part.
void TpApplied::after_last_backward(const ShardedDataParallel& zero,
                                    const std::vector<at::Tensor>& zero_params) {
  reduce_expert_gradients();
  if (!split() || deferred_.empty()) return;
  const auto parts = shard_parts(zero, zero_params);
  std::vector<at::Tensor> replicated;
  for (size_t i = 0; i < zero_params.size(); ++i) {
    if (parts[i].defined() && partial_sum_deferred(zero_params[i])) replicated.push_back(parts[i]);
  }
  if (replicated.empty()) return;
  auto flat = flat_copy(replicated, collective());
  tp().all_reduce(flat);
  torch::NoGradGuard no_grad;
  copy_from_flat(flat, replicated);  // the parts are views of the shards' gradients
}

double TpApplied::square_sum(const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& parts) const {
  return tp_square_sum(params, parts, replicated_, degree_);
}

// A unit's shard is a range of its parameters laid end to end; each range is cut at the
// parameters' bounds.
std::vector<at::Tensor> TpApplied::shard_parts(const ShardedDataParallel& zero,
                                               const std::vector<at::Tensor>& params) {
  const auto members = zero.unit_parameters();
  const int64_t dp_rank = zero.dist().rank();
  std::vector<at::Tensor> parts(params.size());  // each parameter's slice here, if any
  for (size_t u = 0; u < zero.units().size(); ++u) {
    const at::Tensor& grad = zero.parameters()[u].grad();
    if (!grad.defined()) continue;
    const auto g = grad.detach().reshape({-1});
    const int64_t lo = dp_rank * g.numel(), hi = lo + g.numel();
    int64_t at = 0;
    for (size_t i : members[u]) {
      const int64_t begin = std::max(lo, at), end = std::min(hi, at + params[i].numel());
      at += params[i].numel();
      if (begin < end) parts[i] = g.narrow(0, begin - lo, end - begin);
    }
  }
  return parts;
}

void TpApplied::gather_weights() {
  if (!split()) return;
  auto full = gather_full_state(*split_.module, tp());
  torch::NoGradGuard no_grad;
  for (auto& p : whole_.module->named_parameters()) p.value().copy_(full.at(p.key()));
}

void TpApplied::gather_weights(const std::vector<torch::nn::Sequential>& parts) {
  if (!split()) return;
  std::map<const void*, std::string> names;  // the trained build's parameters' names
  for (const auto& p : split_.module->named_parameters()) {
    names[p.value().unsafeGetTensorImpl()] = p.key();
  }
  auto whole = whole_.module->named_parameters();
  torch::NoGradGuard no_grad;
  for (auto part : parts) {                      // (a handle: the same module)
    auto full = gather_full_state(*part, tp());  // under the part's own names
    for (const auto& p : part->named_parameters()) {
      whole[names.at(p.value().unsafeGetTensorImpl())].copy_(full.at(p.key()));
    }
  }
}

void TpApplied::weights_loaded() {
  if (split()) load_full_state(*split_.module, tp(), named_values(*whole_.module));
}

NamedStates TpApplied::join(const NamedStates& mine) const {
  return split() ? join_states(*split_.module, tp(), mine) : mine;
}

NamedStates TpApplied::slice(const NamedStates& whole) const {
  return split() ? slice_states(*split_.module, tp(), whole) : whole;
}

std::map<std::string, at::Tensor> TpApplied::cut(
    const std::map<std::string, at::Tensor>& whole) const {
  return split() ? slice_full_state(*split_.module, tp(), whole) : whole;
}

namespace {
constexpr int kRankBytesTag = 1 << 20;  // point-to-point tags of the optimizer gather
const char* kRankBytesMeshKey = "tensor_parallel/mesh";
std::string rank_bytes_key(int rank) {
  return "tensor_parallel/optimizer/rank" + std::to_string(rank);
}
}  // namespace

void TpApplied::save_rank_bytes(const torch::optim::Optimizer& opt, TrainingState& state,
                                const std::string& layout) const {
  auto all =
      bytes_to_rank_zero(world_, optimizer_bytes(opt), world_.size(), kRankBytesTag, collective());
  for (size_t r = 0; r < all.size(); ++r) {
    state.tensors[rank_bytes_key(static_cast<int>(r))] = all[r];
  }
  state.values[kRankBytesMeshKey] = layout;
}

bool TpApplied::restore_rank_bytes(torch::optim::Optimizer& opt, const TrainingState& state,
                                   const std::string& layout) const {
  auto mesh = state.values.find(kRankBytesMeshKey);
  auto bytes = state.tensors.find(rank_bytes_key(world_.rank()));
  if (mesh == state.values.end() || mesh->second != layout || bytes == state.tensors.end()) {
    return false;
  }
  load_optimizer_bytes(opt, bytes->second);
  return true;
}

std::string TpApplied::slice_dir(const std::string& dir) const {
  return split() ? tensor_slice_dir(dir, degree_, tp().rank()) : dir;
}

void validate_context_parallel(const TrainerOptions& o, int world) {
  const int cp = o.context_parallel.size, tp = std::max(o.tensor_parallel.size, 1);
  const std::string what = "TrainerOptions::context_parallel.size " + std::to_string(cp);
  if (cp < 1) throw UsageError(what + ": the context-parallel degree is at least 1 (1: none)");
  if (cp == 1) return;
  const Strategy s = o.strategy;
  if (s != Strategy::kDDP && s != Strategy::kZero1 && s != Strategy::kZero2 &&
      s != Strategy::kFsdp && s != Strategy::kGrid) {
    throw UsageError(what +
                     " goes with TrainerOptions::strategy ddp, zero1, zero2, fsdp or grid (" +
                     to_string(s) + " does not split sequences yet)");
  }
  if (world % (cp * tp) != 0) {
    throw UsageError(what +
                     (tp > 1 ? " times TrainerOptions::tensor_parallel.size " + std::to_string(tp)
                             : std::string()) +
                     " does not divide the world of " + std::to_string(world) +
                     " ranks; give a world that is a multiple of " + std::to_string(cp * tp));
  }
  if (o.fault_tolerant) {
    throw UsageError(what + " with TrainerOptions::fault_tolerant is not supported yet");
  }
  if (o.ddp.uneven_inputs == UnevenInputs::kJoin) {
    throw UsageError("TrainerOptions::ddp.uneven_inputs join with " + what +
                     " is not supported yet; use fail");
  }
}

void validate_expert_parallel(const TrainerOptions& o, int world) {
  const int ep = o.expert_parallel.size;
  const std::string what = "TrainerOptions::expert_parallel.size " + std::to_string(ep);
  if (ep < 1) throw UsageError(what + ": the expert-parallel degree is at least 1 (1: none)");
  if (ep == 1) return;
  const Strategy s = o.strategy;
  if (s != Strategy::kDDP && s != Strategy::kZero1 && s != Strategy::kZero2 &&
      s != Strategy::kFsdp) {
    throw UsageError(what + " goes with TrainerOptions::strategy ddp, zero1, zero2 or fsdp (" +
                     to_string(s) + " does not spread experts yet)");
  }
  const int data_ranks = world / std::max(o.tensor_parallel.size, 1);
  if (world % std::max(o.tensor_parallel.size, 1) != 0 || data_ranks % ep != 0) {
    throw UsageError(what + " does not divide the " + std::to_string(data_ranks) +
                     " data-parallel ranks of a world of " + std::to_string(world) +
                     "; give an ep degree that divides them");
  }
  if (o.fault_tolerant) {
    throw UsageError(what + " with TrainerOptions::fault_tolerant is not supported yet");
  }
  if (o.ddp.uneven_inputs == UnevenInputs::kJoin) {
    throw UsageError("TrainerOptions::ddp.uneven_inputs join with " + what +
                     " is not supported yet; use fail");
  }
}

void validate_tensor_parallel(const TrainerOptions& o, int world) {
  if (o.tensor_parallel.size < 1) {
    throw UsageError("TrainerOptions::tensor_parallel.size " +
                     std::to_string(o.tensor_parallel.size) +
                     ": the tensor-parallel degree is at least 1 (1: no split)");
  }
  if (o.tensor_parallel.sequence_parallel && o.tensor_parallel.size == 1) {
    throw UsageError(
        "TrainerOptions::tensor_parallel.sequence_parallel splits the sequence over a "
        "tensor-parallel group: give "
        "TrainerOptions::tensor_parallel.size 2 or more with it");
  }
  if (o.tensor_parallel.size == 1) return;
  const bool zero = o.strategy == Strategy::kZero1 || o.strategy == Strategy::kZero2 ||
                    o.strategy == Strategy::kFsdp;
  const bool grid = o.strategy == Strategy::kGrid;
  if (o.strategy != Strategy::kDDP && !zero && !grid) {
    throw UsageError("TrainerOptions::tensor_parallel.size " +
                     std::to_string(o.tensor_parallel.size) +
                     " goes with TrainerOptions::strategy ddp, zero1, zero2, fsdp or grid (" +
                     to_string(o.strategy) + " does not split layers yet)");
  }
  if (world % o.tensor_parallel.size != 0) {
    throw UsageError("TrainerOptions::tensor_parallel.size " +
                     std::to_string(o.tensor_parallel.size) + " does not divide the world of " +
                     std::to_string(world) +
                     " ranks into tensor-parallel groups; give a world that is a multiple of it");
  }
  // A grid's stages each take a tp group: the world is dp x pp x tp (else validate_grid says
  // so, in the grid's words).
  const int per_replica = parallel_dims(o).model_ranks() * std::max(o.context_parallel.size, 1);
  if (per_replica < 1 || world % per_replica != 0) return;
  const int replicas = world / per_replica;
  if (o.batch_size % replicas != 0) {
    throw UsageError("TrainerOptions::batch_size " + std::to_string(o.batch_size) +
                     " does not split over the " + std::to_string(replicas) +
                     " data-parallel replicas of TrainerOptions::tensor_parallel.size " +
                     std::to_string(o.tensor_parallel.size));
  }
}

}  // namespace scaletrain
