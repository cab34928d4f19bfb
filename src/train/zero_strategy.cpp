// The trainer's sharded strategies (Note [Strategies] in strategy.cpp): zero1, zero2 and fsdp,
// ShardedDataParallel (zero.h) over the ranks, one device each. The optimizer steps this rank's
// shards; a checkpoint holds the model's weights, gathered, in the standard place, and the
// optimizer's state over the whole model in the standard place too (Note [ZeRO's optimizer in
// checkpoints]), so it resumes at any world size, with any of the three stages, under any
// strategy with a standard optimizer, and in Python. --amp bf16 is the sharded
// mixed-precision policy (Note [Mixed precision] in src/zero/sharded_step.cpp): parameters and
// buffers compute in bf16, gradients are reduced in fp32 into fp32 master shards; the loss is taken
// in fp32, and checkpoints hold the fp32 master weights.

#include "scaletrain/error.h"
#include "scaletrain/zero.h"
#include "train/balance.h"
#include "train/optimizer_states.h"
#include "train/reshard.h"
#include "train/strategy.h"

namespace scaletrain {
namespace {

// Checkpoints written before Note [ZeRO's optimizer in checkpoints]: the state, flat, in
// TrainingState::tensors.
const std::string kOptimizerPrefix = "zero/optimizer/";

// Note [ZeRO's optimizer in checkpoints]: ZeRO's optimizer steps this rank's shards of flat
// buffers; a gathered checkpoint (dcp, full) holds its state as the standard optimizer's (Note
// [Standard optimizer state] in optimizer_states.h), gathered over the ranks and cut at the
// module's parameters. Another optimizer keeps the flat form under kOptimizerPrefix.

class ZeroStrategy : public TrainStrategy {
 public:
  ZeroStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model,
               int stage)
      : TrainStrategy(d), model_(model), loss_(task.loss), dev_(rank_device(o.device, d)) {
    model.module->to(dev_);
    ShardOptions so;
    so.stage = stage;
    if (o.amp == Amp::kBf16) {
      so.param_dtype = so.buffer_dtype = at::kBFloat16;
      so.reduce_dtype = at::kFloat;
    }
    zero_ = stage == 3
                ? std::make_unique<ShardedDataParallel>(chain_of(model, Strategy::kFsdp), d, so)
                : std::make_unique<ShardedDataParallel>(model.module, d, so);
    // A checkpoint may load into the module before the first step: the full (master) values.
    zero_->gather_full_parameters();
  }

  std::vector<at::Tensor> parameters() override { return zero_->parameters(); }
  int data_rank() const override { return dist_.rank(); }
  int data_replicas() const override { return dist_.size(); }
  at::Device device() const override { return dev_; }

  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool, double weight) override {
    at::Tensor loss = loss_(forward(x), y);
    (weight != 1 ? loss * weight : loss).backward();
    return loss.detach();
  }
  at::Tensor predict(const at::Tensor& x) override { return forward(x); }

  // Each rank sees its own shards' gradients: the ranks agree on one verdict.
  bool gradients_finite() override {
    return on_every_rank(dist_, TrainStrategy::gradients_finite(), dev_);
  }
  // Each rank holds its shards' gradients (zero padding adds nothing): their sum over the world.
  double gradient_square_sum() override {
    return sum_over(dist_, TrainStrategy::gradient_square_sum(), dev_);
  }
  void optimizer_step(torch::optim::Optimizer& opt) override { zero_->step(opt); }
  void weights_loaded() override { zero_->scatter_full_parameters(); }
  void gather_weights() override { zero_->gather_full_parameters(); }
  void train_mode(bool on) override { model_.module->train(on); }

  // Note [ZeRO's optimizer in checkpoints]. Collective (the state is gathered on every rank).
  const torch::optim::Optimizer* saved_optimizer(torch::optim::Optimizer& opt,
                                                 TrainingState& state) override {
    whole_opt_ = standard_optimizer(opt, *model_.module);
    if (!whole_opt_) {
      for (auto& [k, t] : zero_->full_optimizer_state(opt)) state.tensors[kOptimizerPrefix + k] = t;
      return nullptr;
    }
    set_named_states(*whole_opt_, *model_.module, zero_named_states(*zero_, opt, *model_.module));
    return whole_opt_.get();
  }
  torch::optim::Optimizer* optimizer_to_load(torch::optim::Optimizer& opt) override {
    whole_opt_ = standard_optimizer(opt, *model_.module);
    return whole_opt_.get();
  }
  bool restore_optimizer(torch::optim::Optimizer& opt, const TrainingState& state) override {
    if (state.optimizer_restored && whole_opt_) {  // through optimizer_to_load()'s optimizer
      const auto states = named_states(*whole_opt_, *model_.module);
      whole_opt_.reset();
      return load_zero_named_states(*zero_, opt, *model_.module, states);
    }
    std::map<std::string, at::Tensor> full;
    for (const auto& [k, t] : state.tensors) {
      if (k.rfind(kOptimizerPrefix, 0) == 0) full[k.substr(kOptimizerPrefix.size())] = t;
    }
    if (full.empty()) return false;
    zero_->load_full_optimizer_state(opt, full);
    return true;
  }
  std::string save_sharded(const std::string& dir, const TrainingState& state,
                           const torch::optim::Optimizer& opt, int keep,
                           AsyncCheckpointer* writer) override {
    TrainingState s = state;
    describe_for_resharding(*zero_, *model_.module, s);
    return zero_->save(dir, s, opt, keep, writer);
  }
  TrainingState load_sharded(const std::string& dir, int64_t step, torch::optim::Optimizer& opt,
                             int saved_tp) override {
    if (saved_tp <= 1) return zero_->load(dir, step, opt, /*reshard=*/true);
    auto whole = read_whole_checkpoint(dir, step, saved_tp);  // slices joined
    whole.state.optimizer_restored = load_whole_checkpoint(
        whole, *model_.module, *zero_, *model_.module, opt, [](const auto& m) { return m; });
    weights_loaded();
    return whole.state;
  }
  // Each rank checks its own shards; the ranks agree on one verdict (nothing is gathered).
  bool weights_finite() override {
    return on_every_rank(dist_, all_finite(zero_->parameters()), dev_);
  }
  std::vector<DeviceReport> devices() const override {
    int64_t n = 0;
    for (const auto& s : zero_->parameters()) n += s.numel();
    return {{dev_.str(), n, peak_memory(dev_)}};
  }

 private:
  // With --amp bf16, the output back in fp32 for the loss and the metrics.
  at::Tensor forward(const at::Tensor& x) {
    const auto dtype = zero_->options().param_dtype;
    if (zero_->options().stage == 3) {
      auto out = zero_->forward(x);
      return dtype ? out.to(at::kFloat) : out;
    }
    return zero_->forward([&] {
      auto out = model_.forward(dtype && x.is_floating_point() ? x.to(*dtype) : x);
      return dtype ? out.to(at::kFloat) : out;
    });
  }

  Model& model_;
  LossFn loss_;
  at::Device dev_;
  std::unique_ptr<ShardedDataParallel> zero_;
  // The standard optimizer of the last save or load (Note [ZeRO's optimizer in checkpoints]).
  std::unique_ptr<torch::optim::Optimizer> whole_opt_;
};

}  // namespace

std::unique_ptr<TrainStrategy> make_zero_strategy(const TrainTask& task,
                                                  const TrainerOptions& options, const Dist& dist,
                                                  Model& model, int stage) {
  return std::make_unique<ZeroStrategy>(task, options, dist, model, stage);
}

}  // namespace scaletrain
