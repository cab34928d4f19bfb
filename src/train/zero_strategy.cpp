// The trainer's sharded strategies (Note [Strategies] in strategy.cpp): zero1, zero2 and fsdp,
// ShardedDataParallel (zero.h), one device per rank, applied after tensor parallelism (Note
// [Tensor parallelism applied first] in tp_apply.h): over the world at degree 1 (ZeRO), over the
// dp groups of the mesh {dp, tp} above it (2D: ZeRO × TP and FSDP × TP; fsdp over the split
// model's chain of blocks, each block's slices gathered over dp for its forward and backward).
// The optimizer steps this rank's shards (of its slices). A checkpoint holds the model's
// weights, gathered, and the optimizer's state over the whole model, both in the standard place
// (Note [ZeRO's optimizer in checkpoints]), so it resumes at any world size and degree, with any
// of the three stages, under any strategy, and in Python. --amp bf16 at degree 1 is the sharded
// mixed-precision policy (Note [Mixed precision] in src/zero/sharded_step.cpp): parameters and
// buffers compute in bf16, gradients are reduced in fp32 into fp32 master shards, and
// checkpoints hold the fp32 master weights; split (tp, or the experts over ep), the layers
// compute under bf16 autocast instead. The loss is taken in fp32.

#include "checkpoint/checkpoint_dcp.h"
#include "checkpoint/optimizer_state.h"
#include "scaletrain/amp.h"
#include "scaletrain/box.h"
#include "scaletrain/error.h"
#include "scaletrain/zero.h"
#include "train/balance.h"
#include "train/loss_sums.h"
#include "train/optimizer_states.h"
#include "train/own_boxes.h"
#include "train/reshard.h"
#include "train/strategy.h"
#include "train/tp_apply.h"

namespace scaletrain {
namespace {

// Checkpoints written before Note [ZeRO's optimizer in checkpoints], and an optimizer other than
// SGD, Adam and AdamW: the state, flat, in TrainingState::tensors (degree 1), or each rank's
// bytes (split: the same mesh only).
const std::string kOptimizerPrefix = "zero/optimizer/";

// Note [ZeRO's optimizer in checkpoints]: ZeRO's optimizer steps this rank's shards of flat
// buffers; a gathered checkpoint (dcp, full) holds its state as the standard optimizer's (Note
// [Standard optimizer state] in optimizer_states.h), gathered over the ranks, cut at the
// module's parameters and, split, joined over tp.

class ZeroStrategy : public TrainStrategy, StrategyState {
 public:
  ZeroStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model,
               int stage)
      : TrainStrategy(d),
        dev_(rank_device(o.device, d)),
        tp_(task, o, d, model, dev_),
        layout_(tp_.describe() + " " + to_string(o.strategy)) {
    ShardOptions so;
    so.stage = stage;
    // Expert parallelism's experts: whole on each rank, or (fsdp) sharded over edp by their layers.
    so.ignored_parameters = tp_.expert_params();
    if (tp_.split()) {
      so.shared_memory = false;  // a dp group is not every rank of its machine
      if (o.amp == Amp::kBf16) autocast_ = at::kBFloat16;
    } else if (o.amp == Amp::kBf16) {
      so.param_dtype = so.buffer_dtype = at::kBFloat16;
      so.reduce_dtype = at::kFloat;
    }
    if (stage == 3) {  // FSDP gathers the blocks one unit at a time
      chain_ = chain_of(tp_.trained(), Strategy::kFsdp);
      zero_ = std::make_unique<ShardedDataParallel>(chain_, tp_.dp(), so);
    } else {
      zero_ = std::make_unique<ShardedDataParallel>(tp_.trained().module, tp_.dp(), so);
    }
    // A checkpoint may load into the module before the first step: the full (master) values.
    zero_->gather_full_parameters();
    place(tp_.placement(dev_));
  }

  // The shards, and the experts this rank holds whole (expert parallelism).
  std::vector<at::Tensor> parameters() override {
    auto out = zero_->parameters();
    out.insert(out.end(), tp_.expert_params().begin(), tp_.expert_params().end());
    return out;
  }
  StrategyState& state() override { return *this; }

  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool sync, double weight) override {
    tp_.set_aux_loss_scale(weight);
    at::Tensor loss = tp_.loss()(forward(tp_.context_slice(x)), tp_.context_slice(y));
    (weight != 1 ? loss * weight : loss).backward();
    // Once per step, after its last backward: in the gradient shards, where the gradients are.
    if (sync) tp_.after_last_backward(*zero_, zero_parameters());
    return loss.detach();
  }
  // Evaluation runs without autocast (as ddp's does).
  at::Tensor predict(const at::Tensor& x) override {
    return tp_.whole_outputs(forward(tp_.context_slice(x), /*autocast=*/false));
  }
  at::Tensor loss_weight_of(const at::Tensor& y) const override {
    return loss_weight(tp_.context_slice(y));
  }
  std::optional<SplitOutputs> predict_split(const at::Tensor& x) override {
    if (!tp_.evaluates_split()) return std::nullopt;
    return tp_.split_outputs(forward(x, /*autocast=*/false));
  }

  // Each rank sees its own shards' gradients: the ranks agree on one verdict.
  bool gradients_finite() override {
    return on_every_rank(dist_, TrainStrategy::gradients_finite(), tp_.collective());
  }
  // Each rank holds its shards' gradients (zero padding adds nothing): their sum over the world;
  // split, an element of a replicated parameter counts 1/t on each tp rank.
  double gradient_square_sum() override {
    if (!tp_.split()) return sum_over(dist_, TrainStrategy::gradient_square_sum(), dev_);
    const auto params = zero_parameters();
    const double mine = tp_.square_sum(params, TpApplied::shard_parts(*zero_, params));
    return sum_over(dist_, mine, tp_.collective()) + tp_.expert_square_sum();
  }
  void optimizer_step(torch::optim::Optimizer& opt) override { zero_->step(opt); }
  void weights_loaded() override {
    tp_.weights_loaded();
    zero_->scatter_full_parameters();
  }
  void gather_weights() override {
    zero_->gather_full_parameters();
    tp_.gather_weights();
  }
  void train_mode(bool on) override { tp_.trained().module->train(on); }

  // Note [ZeRO's optimizer in checkpoints]. Collective (the state is gathered on every rank).
  const torch::optim::Optimizer* saved_optimizer(torch::optim::Optimizer& opt,
                                                 TrainingState& state) override {
    auto& whole = *tp_.whole().module;
    whole_opt_ = standard_optimizer(opt, whole);
    if (!whole_opt_) return save_other_optimizer(opt, state);
    NamedStates mine = zero_named_states(*zero_, opt, *tp_.trained().module);
    tp_.add_expert_states(opt, mine);
    set_named_states(*whole_opt_, whole, tp_.join(mine));
    return whole_opt_.get();
  }
  torch::optim::Optimizer* optimizer_to_load(torch::optim::Optimizer& opt) override {
    whole_opt_ = standard_optimizer(opt, *tp_.whole().module);
    return whole_opt_.get();
  }
  bool restore_optimizer(torch::optim::Optimizer& opt, const TrainingState& state) override {
    if (state.optimizer_restored && whole_opt_) {  // through optimizer_to_load()'s optimizer
      const auto whole = named_states(*whole_opt_, *tp_.whole().module);
      whole_opt_.reset();
      const auto mine = tp_.slice(whole);
      tp_.set_expert_states(opt, mine);
      return load_zero_named_states(*zero_, opt, *tp_.trained().module, mine);
    }
    return restore_other_optimizer(opt, state);
  }

  // Note [Checkpoints every rank writes] in own_boxes.h: a shard's run of each parameter's
  // (slice's) elements as boxes of its shape, the weights and the state alike.
  std::optional<DcpState> own_boxes(const torch::optim::Optimizer& opt) override {
    if (!writes_own_boxes(opt)) return std::nullopt;
    auto& module = *tp_.trained().module;
    OwnBoxes boxes(module, tp_.split() ? &tp_.tp() : nullptr, opt);
    std::map<const void*, std::string> names;
    for (const auto& p : module.named_parameters())
      names[p.value().unsafeGetTensorImpl()] = p.key();
    const auto params = zero_parameters();
    const auto members = zero_->unit_parameters();
    for (size_t u = 0; u < zero_->units().size(); ++u) {
      const at::Tensor shard = zero_->parameters()[u].detach().reshape({-1});
      const auto state = param_state(opt, zero_->parameters()[u]).value_or(ParamState{});
      const int64_t lo = zero_->dist().rank() * shard.numel(), hi = lo + shard.numel();
      int64_t at = 0;
      for (size_t i : members[u]) {
        const at::Tensor& p = params[i];
        const int64_t start = at, begin = std::max(lo, at), end = std::min(hi, at + p.numel());
        at += p.numel();
        if (begin >= end) continue;  // none of it in this rank's shard
        int64_t taken = begin - lo;  // the run's first element in the shard
        for (const auto& box : flat_range_boxes(p.sizes().vec(), begin - start, end - start)) {
          ParamState part{state.step, {}};
          for (const auto& [k, t] : state.tensors) {
            part.tensors[k] = t.detach().reshape({-1}).narrow(0, taken, box.numel());
          }
          boxes.add(names.at(p.unsafeGetTensorImpl()), box,
                    shard.narrow(0, taken, box.numel()).view(box.sizes), part);
          taken += box.numel();
        }
      }
    }
    const auto& experts = tp_.expert_params();  // one box each (placed by slice_placements)
    for (const auto& p : experts) {
      boxes.add(names.at(p.unsafeGetTensorImpl()), whole(p.sizes().vec()), p,
                param_state(opt, p).value_or(ParamState{}));
    }
    boxes.add_buffers(module);
    DcpState out = boxes.take();
    auto& whole = *tp_.whole().module;
    out.values = dcp_optimizer_values(whole, *standard_optimizer(opt, whole));
    return out;
  }

  // Note [Sharded checkpoints per slice] in run_folder.h: split, each tensor-parallel slice's
  // ZeRO group writes and reads its own folder, resharding over the data-parallel replicas.
  std::string save_sharded(const std::string& dir, const TrainingState& state,
                           const torch::optim::Optimizer& opt, int keep,
                           AsyncCheckpointer* writer) override {
    TrainingState s = state;
    describe_for_resharding(*zero_, *tp_.trained().module, s);
    return zero_->save(tp_.slice_dir(dir), s, opt, keep, writer);
  }
  TrainingState load_sharded(const std::string& dir, int64_t step, torch::optim::Optimizer& opt,
                             int saved_tp) override {
    if (std::max(saved_tp, 1) == tp_.degree()) {
      return zero_->load(tp_.slice_dir(dir), step, opt, /*reshard=*/true);
    }
    // Note [Sharded checkpoints at another degree] in reshard.h.
    auto whole = read_whole_checkpoint(dir, step, saved_tp);
    whole.state.optimizer_restored =
        load_whole_checkpoint(whole, *tp_.whole().module, *zero_, *tp_.trained().module, opt,
                              [&](const auto& m) { return tp_.cut(m); });
    weights_loaded();
    return whole.state;
  }
  // Each rank checks its own shards; the ranks agree on one verdict (nothing is gathered).
  bool weights_finite() override { return on_every_rank(dist_, all_finite(parameters()), dev_); }
  std::vector<DeviceReport> devices() const override {  // the shards and experts it holds
    int64_t n = 0;
    for (const auto& s : zero_->parameters()) n += s.numel();
    for (const auto& e : tp_.expert_params()) n += e.numel();
    return {{dev_.str(), n, peak_memory(dev_)}};
  }

 private:
  // The output in fp32 for the loss and the metrics, under bf16 (the sharded policy's compute
  // copies, or autocast where split and `autocast`).
  at::Tensor forward(const at::Tensor& x, bool autocast = true) {
    std::optional<Autocast> scope;
    if (autocast && autocast_) scope.emplace(dev_.type(), *autocast_);
    const auto dtype = zero_->options().param_dtype;
    at::Tensor out;
    if (chain_) {
      out = zero_->forward(x);
    } else {
      out = zero_->forward(
          [&] { return tp_.trained().forward(dtype && x.is_floating_point() ? x.to(*dtype) : x); });
    }
    return dtype || scope ? out.to(at::kFloat) : out;
  }

  // The parameters of what ZeRO wraps (the chain, for fsdp), which unit_parameters() indexes.
  // The parameters the units hold, in their order (the experts are not among them).
  std::vector<at::Tensor> zero_parameters() const {
    std::vector<at::Tensor> out;
    for (auto& p : chain_ ? chain_->parameters() : tp_.trained().module->parameters()) {
      if (!tp_.is_expert(p)) out.push_back(p);
    }
    return out;
  }

  // An optimizer other than SGD, Adam, AdamW: its state flat (degree 1), or each rank's bytes.
  const torch::optim::Optimizer* save_other_optimizer(torch::optim::Optimizer& opt,
                                                      TrainingState& state) {
    if (!tp_.split()) {
      for (auto& [k, t] : zero_->full_optimizer_state(opt)) state.tensors[kOptimizerPrefix + k] = t;
      return nullptr;
    }
    tp_.save_rank_bytes(opt, state, layout_);
    return nullptr;
  }
  bool restore_other_optimizer(torch::optim::Optimizer& opt, const TrainingState& state) {
    if (tp_.split()) return tp_.restore_rank_bytes(opt, state, layout_);
    std::map<std::string, at::Tensor> full;
    for (const auto& [k, t] : state.tensors) {
      if (k.rfind(kOptimizerPrefix, 0) == 0) full[k.substr(kOptimizerPrefix.size())] = t;
    }
    if (full.empty()) return false;
    zero_->load_full_optimizer_state(opt, full);
    return true;
  }

  at::Device dev_;
  TpApplied tp_;
  std::optional<at::ScalarType> autocast_;  // split, --amp bf16: the layers under autocast
  std::string layout_;                      // the mesh and strategy, of a rank's bytes
  torch::nn::Sequential chain_{nullptr};    // fsdp: the blocks, which zero_ wraps
  std::unique_ptr<ShardedDataParallel> zero_;
  // The standard optimizer of the last save or load (Note [Standard optimizer state]).
  std::unique_ptr<torch::optim::Optimizer> whole_opt_;
};

}  // namespace

std::unique_ptr<TrainStrategy> make_zero_strategy(const TrainTask& task,
                                                  const TrainerOptions& options, const Dist& dist,
                                                  Model& model, int stage) {
  return std::make_unique<ZeroStrategy>(task, options, dist, model, stage);
}

}  // namespace scaletrain
