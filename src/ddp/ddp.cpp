#include "scaletrain/ddp.h"

#include <sstream>

#include "ddp/reducer.h"
#include "dist/model_sync.h"
#include "scaletrain/error.h"

namespace scaletrain {

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 Dist dist, DDPOptions options)
    : module_(std::move(module)), dist_(std::move(dist)), options_(options) {
  if (!module_) throw UsageError("DistributedDataParallel: the module is null");
  require_joined(dist_, "DistributedDataParallel");
  std::vector<at::Tensor> params;
  std::vector<std::string> names, described;
  for (auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad() || options_.ignored_parameters.count(item.key())) continue;
    names.push_back(item.key());
    params.push_back(item.value());
    described.push_back(describe_param(item.key(), item.value()));
  }
  if (params.empty()) {
    throw UsageError("DistributedDataParallel: the module has no parameter that requires grad");
  }
  if (options_.uneven_inputs == UnevenInputs::kJoin && options_.check_replicas_every > 0) {
    throw UsageError(
        "DistributedDataParallel: check_replicas_every needs every rank at the same step, which "
        "UnevenInputs::kJoin does not give; use one of the two, or call check_replicas() after "
        "join()");
  }
  // DDP instances are built in the same order on every rank: number them per rank (in the
  // store, so that ranks sharing one process — threads in tests — count separately).
  const auto instance = static_cast<int>(
      dist_.store_add("scaletrain/ddp/instances/" + std::to_string(dist_.rank()), 1));
  verify_same_model(dist_, described, "ddp", instance);
  broadcast_coalesced(dist_, params, "the parameters");
  if (options_.broadcast_buffers) {
    auto buffers = module_->buffers();
    if (!buffers.empty()) broadcast_coalesced(dist_, buffers, "the buffers");
  }
  reducer_ = std::make_unique<Reducer>(dist_, options_, std::move(params), std::move(names));
  reducer_->open_collectives(instance);
}

DistributedDataParallel::~DistributedDataParallel() = default;

bool DistributedDataParallel::uses_shared_memory() const { return reducer_->comm->shared_memory(); }

std::string DistributedDataParallel::reduce_path() const { return reducer_->comm->path(); }

const std::vector<std::vector<size_t>>& DistributedDataParallel::buckets() const {
  return reducer_->assignment;
}

const std::vector<std::string>& DistributedDataParallel::parameter_names() const {
  return reducer_->names;
}

namespace {

// Note [Uneven inputs]: the flag each rank contributes to the exchange at the start of a step.
constexpr int32_t kJoined = 0, kStepping = 1, kSteppingNoSync = 2;

std::string ranks_where(const std::vector<int32_t>& flags, bool joined) {
  std::string out;
  for (size_t r = 0; r < flags.size(); ++r) {
    if ((flags[r] == kJoined) == joined) out += (out.empty() ? "" : ", ") + std::to_string(r);
  }
  return out;
}

const char* kEvenFix =
    "Give every rank the same number of batches (DistributedSampler pads, or drop_last cuts, the "
    "data set to a multiple of the world size), or let the ranks with data finish: "
    "DDPOptions::uneven_inputs = UnevenInputs::kJoin (scaletrain train --uneven-inputs join).";

}  // namespace

// A parameter moved or cast after DDP was made (model->to(at::kDouble)) no longer fits its
// gradient bucket, and the step would fail later in other words: say what and how to fix it.
static void check_parameters_fit_buckets(const DistributedDataParallel::Reducer& r) {
  for (size_t i = 0; i < r.params.size(); ++i) {
    const auto& p = r.params[i];
    const auto& bucket = r.views[i];
    if (!bucket.defined()) continue;
    if (p.scalar_type() == bucket.scalar_type() && p.device() == bucket.device()) continue;
    throw UsageError("DistributedDataParallel: parameter '" + r.names[i] + "' is now " +
                     c10::toString(p.scalar_type()) + " on " + p.device().str() +
                     ", and DDP was made for it as " + c10::toString(bucket.scalar_type()) +
                     " on " + bucket.device().str() +
                     ": move or cast the model (model->to(...)) before wrapping it in DDP, or "
                     "wrap it again after");
  }
}

void DistributedDataParallel::pre_forward() {
  check_parameters_fit_buckets(*reducer_);
  ++step_;
  if (options_.uneven_inputs != UnevenInputs::kOff && dist_.size() > 1) {
    // Note [Uneven inputs]: every rank with a batch says whether its backward will all-reduce;
    // join() says "joined".
    last_flags_ = reducer_->exchange_flags(reducer_->sync ? kStepping : kSteppingNoSync,
                                           "uneven-input check of step " + std::to_string(step_));
    const std::string joined = ranks_where(last_flags_, true);
    if (!joined.empty() && options_.uneven_inputs == UnevenInputs::kFail) {
      throw Error("rank " + std::to_string(dist_.rank()) + ": uneven inputs: rank(s) " + joined +
                  " ran out of batches before step " + std::to_string(step_) +
                  " while this rank still has data. " + kEvenFix);
    }
    if (options_.uneven_inputs == UnevenInputs::kJoin && !options_.divide_by_initial_world_size) {
      int stepping = 0;
      for (auto f : last_flags_) stepping += f != kJoined ? 1 : 0;
      reducer_->divisor = stepping;
    }
  }
  if (options_.broadcast_buffers) {
    auto buffers = module_->buffers();
    if (!buffers.empty()) broadcast_coalesced(dist_, buffers, "the buffers");
  }
  if (options_.check_replicas_every > 0 && step_ % options_.check_replicas_every == 0) {
    check_replicas();
  }
}

void DistributedDataParallel::post_forward(const std::vector<at::Tensor>& outputs) {
  reducer_->prepare(outputs);
}

at::Tensor DistributedDataParallel::forward(const at::Tensor& input) {
  if (!call_) {
    throw UsageError(
        "DistributedDataParallel::forward(x): the module was given to DDP as a plain "
        "torch::nn::Module, or its type has no at::Tensor forward(const at::Tensor&); construct "
        "DDP with the module's own type (std::shared_ptr<Net>), or call "
        "ddp.forward([&] { return model->forward(...); })");
  }
  return forward([&] { return call_(input); });
}

void DistributedDataParallel::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  pre_forward();
  post_forward(outputs);
}

at::Tensor DistributedDataParallel::forward(const std::function<at::Tensor()>& fn) {
  pre_forward();
  at::Tensor out = fn();
  post_forward({out});
  return out;
}

std::vector<at::Tensor> DistributedDataParallel::forward_many(
    const std::function<std::vector<at::Tensor>()>& fn) {
  pre_forward();
  auto outs = fn();
  post_forward(outs);
  return outs;
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.reducer_->sync) {
  ddp_.reducer_->sync = false;
}

DistributedDataParallel::NoSync::~NoSync() { ddp_.reducer_->sync = previous_; }

void DistributedDataParallel::join() {
  if (options_.uneven_inputs == UnevenInputs::kOff || dist_.size() == 1) return;
  // Note [Uneven inputs]: the ranks still stepping exchange their flags at the start of each
  // step; a joined rank answers each such exchange with "joined" and, under kJoin, takes part in
  // that step's collectives (the buffer broadcast, and zeros for every bucket's all-reduce when
  // the step synchronises) until an exchange finds every rank joined.
  while (true) {
    auto before = last_flags_;
    last_flags_ = reducer_->exchange_flags(kJoined, "join (uneven-input check)");
    const std::string active = ranks_where(last_flags_, false);
    if (active.empty()) {
      if (options_.uneven_inputs == UnevenInputs::kJoin) sync_after_join(before);
      return;
    }
    if (options_.uneven_inputs == UnevenInputs::kFail) {
      throw Error("rank " + std::to_string(dist_.rank()) +
                  ": uneven inputs: this rank ran out of batches after step " +
                  std::to_string(step_) + " while rank(s) " + active + " still have data. " +
                  kEvenFix);
    }
    if (options_.broadcast_buffers) {
      auto buffers = module_->buffers();
      if (!buffers.empty()) broadcast_coalesced(dist_, buffers, "the buffers");
    }
    bool synchronises = false;
    for (auto f : last_flags_) synchronises |= f == kStepping;
    if (synchronises) reducer_->shadow_backward();
  }
}

void DistributedDataParallel::sync_after_join(const std::vector<int32_t>& before) {
  // The ranks that stepped in the last step before everyone joined hold the newest weights;
  // every rank saw the same exchanges, so every rank picks the same one.
  int authority = -1;
  for (size_t r = 0; r < before.size(); ++r) {
    if (before[r] != kJoined) authority = static_cast<int>(r);
  }
  if (authority < 0) return;  // nobody stepped since the last join: nothing to bring in line
  std::vector<at::Tensor> params;
  for (auto& p : module_->named_parameters()) {
    if (!options_.ignored_parameters.count(p.key())) params.push_back(p.value());
  }
  broadcast_coalesced(dist_, params, "the weights after join", authority);
  auto buffers = module_->buffers();
  if (!buffers.empty()) broadcast_coalesced(dist_, buffers, "the buffers after join", authority);
}

void DistributedDataParallel::check_replicas() {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  for (auto& item : module_->named_parameters()) {
    if (options_.ignored_parameters.count(item.key())) continue;
    names.push_back(item.key()), tensors.push_back(item.value());
  }
  for (auto& item : module_->named_buffers())
    names.push_back(item.key()), tensors.push_back(item.value());
  auto sums = at::empty({static_cast<int64_t>(tensors.size()), 2}, at::kDouble);
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto t = tensors[i].detach().to(at::kCPU, at::kDouble);
    sums[static_cast<int64_t>(i)][0] = t.sum();
    sums[static_cast<int64_t>(i)][1] = (t * t).sum();
  }
  const auto all = dist_.all_gather(sums, "replica check");
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::string differ;
    for (int r = 1; r < dist_.size(); ++r) {
      if (!at::equal(all[0][static_cast<int64_t>(i)],
                     all[static_cast<size_t>(r)][static_cast<int64_t>(i)])) {
        differ += (differ.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    if (!differ.empty()) {
      throw Error("rank " + std::to_string(dist_.rank()) + ": replicas drifted apart: '" +
                  names[i] + "' differs between rank 0 and rank(s) " + differ +
                  " (checked at step " + std::to_string(step_) +
                  "). Something updated one "
                  "replica alone: an optimizer step outside DDP, rank-dependent buffers, or "
                  "non-deterministic kernels.");
    }
  }
}

void DistributedDataParallel::zero_grad() {
  for (auto& b : reducer_->buckets) b.flat.zero_();
  for (size_t i = 0; i < reducer_->params.size(); ++i) {
    auto& g = reducer_->params[i].mutable_grad();
    if (g.defined() && g.data_ptr() != reducer_->views[i].data_ptr()) g.zero_();
  }
}

}  // namespace scaletrain
