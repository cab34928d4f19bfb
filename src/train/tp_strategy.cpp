// Note [Tensor-parallel strategy]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ddp with TrainerOptions::tensor_parallel.size = t > 1: the world is the mesh {dp: W/t, tp: t}
// (row-major: ranks r·t … r·t + t − 1 are replica r's tensor-parallel group). Each rank keeps two
// models. The task's model (the trainer's Model) stays whole on the CPU: checkpoints, model.pt
// and resumes read and write it under PyTorch's names, whatever the degree. A second build of
// the task's model, given the whole one's weights, is split over tp (Model::parallelize) and
// trains, wrapped in DDP over dp. gather_weights() assembles the split weights into the whole
// model (gather_full_state) and weights_loaded() cuts them again (load_full_state), so a
// checkpoint saved at one degree resumes at another. The optimizer steps the split parameters:
// its state goes into the checkpoint as the standard optimizer's over the whole model (the
// slices joined, Note [Standard optimizer state] in optimizer_states.h), so it goes on at any
// degree, under any strategy, and in Python.
// Data: replica r reads slice r of W/t; its tp ranks read the same batch. Metrics are counted
// once per rank, so each replica's are counted t times, numerators and denominators alike: their
// ratios are the replicas' means. The training loss is counted once per replica, on its tp rank
// 0 (Note [Global losses] in loss_sums.cpp), so that its sums mean the same at every layout.
//
// zero1, zero2 and fsdp (2D, ZeRO × TP and FSDP × TP): ShardedDataParallel over dp takes DDP's
// place, over the split model (fsdp: over its chain of blocks, each block's slices gathered over
// dp for its forward and backward); the optimizer steps its shards of the split parameters (each
// tp rank's shards are of its own slices). The gradient norm is taken on the shards: an element
// of a replicated parameter is on every tp rank, and counts 1/t on each.
//
// Sequence parallelism's sum of the replicated gradients over tp runs once per step, after its
// last backward, in one all-reduce (the plan's hooks defer to it, Note [Partial gradients summed
// in backward] in src/tp/sequence_parallel.cpp): over the whole gradients after DDP's average,
// or on ZeRO's gradient shards, where the gradients are by then; the sums over tp and dp
// commute. A program's own model does nothing for it (Model::after_backward, if it gives one,
// runs after the step's last backward).

#include <algorithm>
#include <optional>
#include <set>

#include "scaletrain/amp.h"
#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/mesh.h"
#include "scaletrain/tensor_parallel.h"
#include "scaletrain/zero.h"
#include "tp/partial_sums.h"
#include "train/balance.h"
#include "train/optimizer_states.h"
#include "train/reshard.h"
#include "train/run_folder.h"
#include "train/strategy.h"

namespace scaletrain {
namespace {

const char* kMeshKey = "tensor_parallel/mesh";
constexpr int kOptimizerTag = 1 << 20;  // point-to-point tags of the optimizer gather
std::string optimizer_key(int rank) {
  return "tensor_parallel/optimizer/rank" + std::to_string(rank);
}

class TensorParallelStrategy : public TrainStrategy {
 public:
  TensorParallelStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d,
                         Model& model)
      : TrainStrategy(d),
        whole_(model),
        mesh_(parallel_dims(o).resolve(d.size()).mesh({"dp", "tp"})),
        groups_(mesh_groups(d, mesh_, "tensor_parallel")),
        dev_(rank_device(o.device, d)),
        amp_(o.amp == Amp::kBf16   ? std::optional<at::ScalarType>(at::kBFloat16)
             : o.amp == Amp::kFp16 ? std::optional<at::ScalarType>(at::kHalf)
                                   : std::nullopt),
        scaler_([&] {
          GradScalerOptions so;
          so.enabled = o.amp == Amp::kFp16;  // bf16 has fp32's range: no scaling
          so.agree_over = &d;                // the ranks hold different slices: they skip together
          return so;
        }()) {
    split_ =
        split_build(task, whole_, dist_, tp(), o.tensor_parallel.sequence_parallel, collective());
    split_.module->to(dev_);
    replicated_ = replicated_set(*split_.module);
    if (o.tensor_parallel.sequence_parallel) {  // summed once per step, in one all-reduce
      deferred_ = replicated_parameters(*split_.module);
      defer_partial_sums(deferred_);
    }
    loss_ = split_.parallel_loss ? split_.parallel_loss : task.loss;
    if (o.strategy == Strategy::kZero1 || o.strategy == Strategy::kZero2 ||
        o.strategy == Strategy::kFsdp) {
      ShardOptions so;
      so.stage = o.strategy == Strategy::kZero1 ? 1 : o.strategy == Strategy::kZero2 ? 2 : 3;
      so.shared_memory = false;  // a dp group is not every rank of its machine
      if (so.stage == 3) {       // FSDP gathers the split model's blocks one unit at a time
        chain_ = chain_of(split_, Strategy::kFsdp);
        zero_ = std::make_unique<ShardedDataParallel>(chain_, groups_.at("dp"), so);
      } else {
        zero_ = std::make_unique<ShardedDataParallel>(split_.module, groups_.at("dp"), so);
      }
      zero_->gather_full_parameters();
      layout_ = mesh_.describe() + " " + to_string(o.strategy);
    } else if (mesh_.size("dp") > 1) {
      ddp_ = std::make_unique<DistributedDataParallel>(split_.module, groups_.at("dp"), o.ddp);
    }
  }

  std::vector<at::Tensor> parameters() override {
    return zero_ ? zero_->parameters() : split_.module->parameters();
  }
  int data_rank() const override { return mesh_.coordinate(dist_.rank(), "dp"); }
  int data_replicas() const override { return mesh_.size("dp"); }
  at::Device device() const override { return dev_; }
  // The group's ranks compute the same loss of their replica's batch (Note [Global losses]).
  bool counts_loss() const override { return tp().rank() == 0; }

  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool sync, double weight) override {
    std::optional<DistributedDataParallel::NoSync> local;
    if (ddp_ && !sync) local.emplace(*ddp_);
    at::Tensor out;
    {
      std::optional<Autocast> autocast;  // the layers' products, and what they send
      if (amp_) autocast.emplace(dev_.type(), *amp_);
      auto forward = [&] { return split_.forward(x); };
      out = chain_  ? zero_->forward(x)
            : zero_ ? zero_->forward(forward)
            : ddp_  ? ddp_->forward(forward)
                    : forward();
    }
    at::Tensor loss = loss_(amp_ ? out.to(at::kFloat) : out, y);
    scaler_.scale(weight != 1 ? loss * weight : loss).backward();
    // Once per step, after its last backward: over what the step accumulated (under ZeRO, in its
    // gradient shards, where the gradients are by then).
    if (sync && !deferred_.empty()) {
      if (zero_) {
        sum_replicated_shards_over_tp();
      } else {
        sum_deferred_partial_gradients(deferred_, tp());
      }
    }
    if (sync && !zero_ && split_.after_backward) split_.after_backward();
    return loss.detach();
  }

  // Split parameters hold a slice of their gradient on each rank of the group; replicated ones
  // (LayerNorms, biases of rowwise layers) the same whole gradient on each.
  double gradient_square_sum() override {
    if (zero_) return sum_over(dist_, shard_square_sum(), collective());
    auto params = split_.module->parameters();
    std::vector<at::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    return sum_over(tp(), weighted_square_sum(params, grads), collective());
  }

  // ZeRO: each rank holds its shards' gradients; the ranks agree on one verdict.
  bool gradients_finite() override {
    if (amp_ == at::kHalf) return true;  // fp16: the scaler skips such steps, on every rank
    const bool mine = TrainStrategy::gradients_finite();
    return zero_ ? on_every_rank(dist_, mine, collective()) : mine;
  }
  void optimizer_step(torch::optim::Optimizer& opt) override {
    if (zero_) {
      zero_->step(opt);
    } else {
      scaler_.step(opt);  // fp16: skips a step whose gradients overflowed on any rank
      scaler_.update();
    }
  }

  at::Tensor predict(const at::Tensor& x) override {
    at::Tensor out = chain_ ? zero_->forward(x) : split_.forward(x);
    return split_.output_split ? gather_from_region(out, tp(), -1) : out;
  }
  std::optional<SplitOutputs> predict_split(const at::Tensor& x) override {
    if (!split_.output_split) return std::nullopt;
    at::Tensor out = chain_ ? zero_->forward(x) : split_.forward(x);
    return SplitOutputs{out, ClassSlice{&tp(), tp().rank() * out.size(-1)}};
  }
  void zero_grad(torch::optim::Optimizer& opt) override {
    if (ddp_) {
      ddp_->zero_grad();
    } else {  // ZeRO's shards are the optimizer's parameters
      opt.zero_grad();
    }
  }
  void end_epoch() override {
    if (ddp_) ddp_->join();
  }
  void train_mode(bool on) override { split_.module->train(on); }
  GradScaler* scaler() override { return &scaler_; }

  void gather_weights() override {
    if (zero_) zero_->gather_full_parameters();
    auto full = gather_full_state(*split_.module, tp());
    torch::NoGradGuard no_grad;
    for (auto& p : whole_.module->named_parameters()) p.value().copy_(full.at(p.key()));
  }
  void weights_loaded() override {
    load_full_state(*split_.module, tp(), named_values(*whole_.module));
    if (zero_) zero_->scatter_full_parameters();
  }

  // Note [Standard optimizer state]: the state of every slice (and, under ZeRO, every shard)
  // joined into the standard optimizer over the whole model, on every rank (collective); an
  // optimizer of another kind saves each rank's bytes, which load at the same mesh only.
  const torch::optim::Optimizer* saved_optimizer(torch::optim::Optimizer& opt,
                                                 TrainingState& state) override {
    whole_opt_ = standard_optimizer(opt, *whole_.module);
    if (!whole_opt_) return save_optimizer_bytes(opt, state);
    const auto mine =
        zero_ ? zero_named_states(*zero_, opt, *split_.module) : named_states(opt, *split_.module);
    set_named_states(*whole_opt_, *whole_.module, join_states(*split_.module, tp(), mine));
    return whole_opt_.get();
  }
  torch::optim::Optimizer* optimizer_to_load(torch::optim::Optimizer& opt) override {
    whole_opt_ = standard_optimizer(opt, *whole_.module);
    return whole_opt_.get();
  }
  bool restore_optimizer(torch::optim::Optimizer& opt, const TrainingState& state) override {
    if (state.optimizer_restored && whole_opt_) {  // any mesh: this rank's slices and shards
      const auto mine =
          slice_states(*split_.module, tp(), named_states(*whole_opt_, *whole_.module));
      whole_opt_.reset();
      if (zero_) return load_zero_named_states(*zero_, opt, *split_.module, mine);
      set_named_states(opt, *split_.module, mine);
      return true;
    }
    auto mesh = state.values.find(kMeshKey);  // each rank's bytes: the same mesh only
    auto bytes = state.tensors.find(optimizer_key(dist_.rank()));
    if (mesh == state.values.end() || mesh->second != layout_ || bytes == state.tensors.end()) {
      return false;
    }
    load_optimizer_bytes(opt, bytes->second);
    return true;
  }

  // Note [Sharded checkpoints per slice] in run_folder.h: each tensor-parallel slice's ZeRO
  // group writes and reads its own folder, resharding over the data-parallel replicas.
  std::string save_sharded(const std::string& dir, const TrainingState& state,
                           const torch::optim::Optimizer& opt, int keep,
                           AsyncCheckpointer* writer) override {
    if (!zero_) return TrainStrategy::save_sharded(dir, state, opt, keep, writer);
    TrainingState s = state;
    describe_for_resharding(*zero_, *split_.module, s);
    return zero_->save(slice_dir(dir), s, opt, keep, writer);
  }
  TrainingState load_sharded(const std::string& dir, int64_t step, torch::optim::Optimizer& opt,
                             int saved_tp) override {
    if (!zero_) return TrainStrategy::load_sharded(dir, step, opt, saved_tp);
    if (saved_tp == tp().size()) return zero_->load(slice_dir(dir), step, opt, /*reshard=*/true);
    // Note [Sharded checkpoints at another degree] in reshard.h.
    auto whole = read_whole_checkpoint(dir, step, saved_tp);
    whole.state.optimizer_restored = load_whole_checkpoint(
        whole, *whole_.module, *zero_, *split_.module, opt,
        [&](const auto& m) { return slice_full_state(*split_.module, tp(), m); });
    weights_loaded();
    return whole.state;
  }
  bool weights_finite() override {  // one verdict for every rank, nothing gathered
    return on_every_rank(dist_, all_finite(parameters()), dev_);
  }

  std::vector<DeviceReport> devices() const override {  // ZeRO: the shards the rank holds
    int64_t n = 0;
    for (const auto& p : zero_ ? zero_->parameters() : split_.module->parameters()) n += p.numel();
    return {{dev_.str(), n, peak_memory(dev_)}};
  }

 private:
  // Tensors of (parts of) `params`' gradients, by parameter: their square sum with a replicated
  // parameter's counted 1/t (it is on every tp rank).
  double weighted_square_sum(const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& parts) const {
    return tp_square_sum(params, parts, replicated_, tp().size());
  }

  // ZeRO: this rank's shards' part of the square sum (a unit's shard is a range of its
  // parameters laid end to end; each range is cut at the parameters' bounds).
  double shard_square_sum() const {
    const auto params = zero_parameters();
    return weighted_square_sum(params, shard_parts(params));
  }

  // Sequence parallelism under ZeRO (Note [Tensor-parallel strategy]): the replicated
  // parameters' parts of this rank's gradient shards, summed over tp. The tp ranks' split
  // models have the same shapes, so their units and shards line up part for part.
  void sum_replicated_shards_over_tp() const {
    const auto params = zero_parameters();
    const auto parts = shard_parts(params);
    std::vector<at::Tensor> replicated;
    for (size_t i = 0; i < params.size(); ++i) {
      if (parts[i].defined() && partial_sum_deferred(params[i])) replicated.push_back(parts[i]);
    }
    if (replicated.empty()) return;
    auto flat = flat_copy(replicated, collective());
    tp().all_reduce(flat);
    torch::NoGradGuard no_grad;
    copy_from_flat(flat, replicated);  // the parts are views of the shards' gradients
  }

  // The parameters of what ZeRO wraps (the chain, for fsdp), which unit_parameters() indexes.
  std::vector<at::Tensor> zero_parameters() const {
    return chain_ ? chain_->parameters() : split_.module->parameters();
  }

  // Each parameter's part of this rank's gradient shards (a view), where the shards hold one.
  std::vector<at::Tensor> shard_parts(const std::vector<at::Tensor>& params) const {
    const auto members = zero_->unit_parameters();
    const int64_t dp_rank = groups_.at("dp").rank();
    std::vector<at::Tensor> parts(params.size());  // each parameter's slice here, if any
    for (size_t u = 0; u < zero_->units().size(); ++u) {
      const at::Tensor& grad = zero_->parameters()[u].grad();
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

  // An optimizer of another kind than SGD, Adam, AdamW: every rank's bytes onto rank 0, which
  // writes the checkpoint.
  const torch::optim::Optimizer* save_optimizer_bytes(torch::optim::Optimizer& opt,
                                                      TrainingState& state) {
    auto all =
        bytes_to_rank_zero(dist_, optimizer_bytes(opt), dist_.size(), kOptimizerTag, collective());
    for (size_t r = 0; r < all.size(); ++r) {
      state.tensors[optimizer_key(static_cast<int>(r))] = all[r];
    }
    state.values[kMeshKey] = layout_;
    return nullptr;
  }

  const Dist& tp() const { return groups_.at("tp"); }
  std::string slice_dir(const std::string& dir) const {
    return tensor_slice_dir(dir, mesh_.size("tp"), tp().rank());
  }
  at::Device collective() const {
    return dist_.backend_name == "nccl" ? dev_ : at::Device(at::kCPU);
  }

  Model& whole_;
  Model split_;
  DeviceMesh mesh_;
  std::map<std::string, Dist> groups_;
  at::Device dev_;
  std::optional<at::ScalarType> amp_;  // autocast's dtype: bf16 or fp16
  GradScaler scaler_;                  // fp16 (ddp): loss scaling, one verdict for all ranks
  LossFn loss_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<ShardedDataParallel> zero_;  // zero1, zero2, fsdp: over dp instead of ddp_
  torch::nn::Sequential chain_{nullptr};       // fsdp: the split model's blocks, which zero_ wraps
  std::string layout_ = mesh_.describe();      // the optimizer state's: mesh and strategy
  std::set<const void*> replicated_;  // the split model's parameters whole on every tp rank
  std::vector<at::Tensor> deferred_;  // sequence parallelism's partial sums, this strategy's
  // The standard optimizer of the last save or load (Note [Standard optimizer state]).
  std::unique_ptr<torch::optim::Optimizer> whole_opt_;
};

}  // namespace

std::unique_ptr<TrainStrategy> make_tensor_parallel_strategy(const TrainTask& task,
                                                             const TrainerOptions& options,
                                                             const Dist& dist, Model& model) {
  return std::make_unique<TensorParallelStrategy>(task, options, dist, model);
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
  const int per_replica = parallel_dims(o).model_ranks();
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
