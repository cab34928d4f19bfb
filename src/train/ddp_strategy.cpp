// The ddp strategy (Note [Strategies] in strategy.cpp): DistributedDataParallel over the ranks,
// one device each, applied after tensor parallelism (Note [Tensor parallelism applied first] in
// tp_apply.h): over the world at degree 1, over the dp groups of the mesh {dp, tp} above it.
// Mixed precision under autocast, with a GradScaler for fp16.

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>

#include <memory>
#include <optional>

#include "checkpoint/checkpoint_dcp.h"
#include "scaletrain/amp.h"
#include "scaletrain/ddp.h"
#include "train/loss_sums.h"
#include "train/optimizer_states.h"
#include "train/own_boxes.h"
#include "train/strategy.h"
#include "train/tp_apply.h"

namespace scaletrain {
namespace {

class DdpStrategy : public TrainStrategy, StrategyState {
 public:
  DdpStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model)
      : TrainStrategy(d),
        dev_(rank_device(o.device, d)),
        tp_(task, o, d, model, dev_),
        amp_(o.amp != Amp::kNone),
        fp16_(o.amp == Amp::kFp16),
        amp_dtype_(o.amp == Amp::kFp16 ? at::kHalf : at::kBFloat16),
        scaler_([&] {
          GradScalerOptions so;
          so.enabled = o.amp == Amp::kFp16;  // bf16 has fp32's range: no scaling
          // Split: the ranks hold different slices, and skip together.
          if (tp_.split()) so.agree_over = &d;
          return so;
        }()) {
    if (!tp_.split() || tp_.dp().size() > 1) {  // dp x cp ranks average the gradients
      DDPOptions ddp = o.ddp;
      ddp.ignored_parameters = tp_.expert_names();  // averaged over their edp group instead
      ddp_ = std::make_unique<DistributedDataParallel>(tp_.trained().module, tp_.dp(), ddp);
    }
    place(tp_.placement(dev_));
  }

  std::vector<at::Tensor> parameters() override { return module().parameters(); }
  StrategyState& state() override { return *this; }

  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool sync, double weight) override {
    std::optional<DistributedDataParallel::NoSync> local;
    if (ddp_ && !sync) local.emplace(*ddp_);
    const at::Tensor xs = tp_.context_slice(x);  // this rank's slice of each sequence, if cp
    tp_.set_aux_loss_scale(weight);
    at::Tensor out;
    {
      std::optional<Autocast> autocast;  // the layers' products, and what they send
      if (amp_) autocast.emplace(dev_.type(), amp_dtype_);
      auto forward = [&] { return tp_.trained().forward(xs); };
      out = ddp_ ? ddp_->forward(forward) : forward();
    }
    at::Tensor loss = tp_.loss()(amp_ ? out.to(at::kFloat) : out, tp_.context_slice(y));
    scaler_.scale(weight != 1 ? loss * weight : loss).backward();
    if (sync) tp_.after_last_backward();
    return loss.detach();
  }

  at::Tensor predict(const at::Tensor& x) override {
    return tp_.whole_outputs(tp_.trained().forward(tp_.context_slice(x)));
  }
  std::optional<SplitOutputs> predict_split(const at::Tensor& x) override {
    if (!tp_.evaluates_split()) return std::nullopt;
    return tp_.split_outputs(tp_.trained().forward(x));
  }
  at::Tensor loss_weight_of(const at::Tensor& y) const override {
    return loss_weight(tp_.context_slice(y));
  }
  bool gradients_finite() override {
    return fp16_ || TrainStrategy::gradients_finite();  // fp16: the scaler skips such steps
  }
  at::Tensor gradients_finite_flag() override {  // averaged gradients: the same on every rank
    if (fp16_ || tp_.split()) return {};         // the scaler checks, and skips such steps
    std::vector<at::Tensor> grads;
    for (auto& p : module().parameters()) {
      if (p.grad().defined() && p.grad().numel() > 0) grads.push_back(p.grad());
    }
    if (!dev_.is_cuda()) return all_finite_flag(grads);
    // One multi-tensor pass over the gradients (GradScaler's check, scaling by exactly 1).
    auto found = at::zeros({1}, at::TensorOptions(at::kFloat).device(dev_));
    if (!grads.empty()) {
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, at::ones_like(found));
    }
    return found.eq(0).squeeze();
  }
  // Split parameters hold a slice of their gradient on each rank of the group; replicated ones
  // (LayerNorms, biases of rowwise layers) the same whole gradient on each.
  double gradient_square_sum() override {
    if (!tp_.split()) return TrainStrategy::gradient_square_sum();
    std::vector<at::Tensor> params, grads;
    for (const auto& p : module().parameters()) {
      if (tp_.is_expert(p)) continue;  // the experts' below, over their ep group
      params.push_back(p);
      grads.push_back(p.grad());
    }
    return sum_over(tp_.tp(), tp_.square_sum(params, grads), tp_.collective()) +
           tp_.expert_square_sum();
  }
  void optimizer_step(torch::optim::Optimizer& opt) override {
    scaler_.step(opt);  // skips a step whose gradients overflowed (fp16), on every rank
    scaler_.update();
  }
  void zero_grad(torch::optim::Optimizer& opt) override {
    if (ddp_) {
      ddp_->zero_grad();  // keeps the views
      tp_.zero_expert_gradients();
    } else {
      opt.zero_grad();
    }
  }
  void end_epoch() override {
    if (ddp_) ddp_->join();
  }
  void train_mode(bool on) override { module().train(on); }
  GradScaler* scaler() override { return &scaler_; }
  void gather_weights() override { tp_.gather_weights(); }
  void weights_loaded() override { tp_.weights_loaded(); }
  bool weights_finite() override {  // split: one verdict for every rank, nothing gathered
    if (!tp_.split()) return all_finite(parameters());
    return on_every_rank(dist_, all_finite(parameters()), dev_);
  }

  // Note [Standard optimizer state]: split, the slices' state joined into the standard
  // optimizer over the whole model (collective); an optimizer of another kind saves each rank's
  // bytes, which load at the same mesh only.
  const torch::optim::Optimizer* saved_optimizer(torch::optim::Optimizer& opt,
                                                 TrainingState& state) override {
    if (!tp_.split()) return &opt;
    whole_opt_ = standard_optimizer(opt, *tp_.whole().module);
    if (!whole_opt_) {
      tp_.save_rank_bytes(opt, state, tp_.describe());
      return nullptr;
    }
    set_named_states(*whole_opt_, *tp_.whole().module,
                     tp_.join(named_states(opt, *tp_.trained().module)));
    return whole_opt_.get();
  }
  torch::optim::Optimizer* optimizer_to_load(torch::optim::Optimizer& opt) override {
    if (!tp_.split()) return &opt;
    whole_opt_ = standard_optimizer(opt, *tp_.whole().module);
    return whole_opt_.get();
  }
  bool restore_optimizer(torch::optim::Optimizer& opt, const TrainingState& state) override {
    if (!tp_.split()) return state.optimizer_restored;
    if (state.optimizer_restored && whole_opt_) {  // any mesh: this rank's slices
      const auto whole = named_states(*whole_opt_, *tp_.whole().module);
      whole_opt_.reset();
      set_named_states(opt, *tp_.trained().module, tp_.slice(whole));
      return true;
    }
    return tp_.restore_rank_bytes(opt, state, tp_.describe());
  }

  // Note [Checkpoints every rank writes] in own_boxes.h: split, each rank its slices (the
  // replicas' are the same: the lowest rank's are written); whole, rank 0 writes it all.
  std::optional<DcpState> own_boxes(const torch::optim::Optimizer& opt) override {
    if (!tp_.split() || !writes_own_boxes(opt)) return std::nullopt;
    OwnBoxes boxes(module(), &tp_.tp(), opt);
    for (const auto& p : module().named_parameters()) {
      boxes.add(p.key(), whole(p.value().sizes().vec()), p.value(),
                param_state(opt, p.value()).value_or(ParamState{}));
    }
    boxes.add_buffers(module());
    DcpState out = boxes.take();
    auto& whole_model = *tp_.whole().module;
    out.values = dcp_optimizer_values(whole_model, *standard_optimizer(opt, whole_model));
    return out;
  }

  std::vector<DeviceReport> devices() const override {
    int64_t n = 0;
    for (const auto& p : module().parameters()) n += p.numel();
    return {{dev_.str(), n, peak_memory(dev_)}};
  }

 private:
  torch::nn::Module& module() const { return *tp_.trained().module; }
  at::Device dev_;
  TpApplied tp_;
  bool amp_, fp16_;
  at::ScalarType amp_dtype_;
  GradScaler scaler_;
  std::unique_ptr<DistributedDataParallel> ddp_;  // absent only for tp over the whole world
  // The standard optimizer of the last save or load (Note [Standard optimizer state]).
  std::unique_ptr<torch::optim::Optimizer> whole_opt_;
};

}  // namespace

std::unique_ptr<TrainStrategy> make_ddp_strategy(const TrainTask& task,
                                                 const TrainerOptions& options, const Dist& dist,
                                                 Model& model) {
  return std::make_unique<DdpStrategy>(task, options, dist, model);
}

}  // namespace scaletrain
