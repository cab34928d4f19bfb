// The strategies of one model whose optimizer covers all its parameters (Note [Strategies] in
// strategy.cpp): ddp (DistributedDataParallel, one device per rank), dp (DataParallel's replicas
// in one process) and pipeline (the model's blocks in stages over devices); and make_strategy(),
// which picks any strategy from the options.

#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/data_parallel.h"
#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/intra_op_threads.h"
#include "scaletrain/pipeline.h"
#include "train/balance.h"
#include "train/strategy.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>

namespace scaletrain {

namespace {

int64_t count(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

// dp's replicas and a pipeline's stages are threads of one process: on CPU "devices" they share
// the process's cores, so each takes its share of the intra-op threads instead of all of them
// (two replicas of two threads each on two cores ran at half the speed of one device).
std::unique_ptr<IntraOpThreads> share_cores(const std::vector<at::Device>& devices) {
  for (const auto& d : devices) {
    if (!d.is_cpu()) return nullptr;
  }
  const int n = static_cast<int>(devices.size());
  return std::make_unique<IntraOpThreads>(std::max(1, at::get_num_threads() / n));
}

// One report per device: the parameters of the module on it, and its peak memory.
std::vector<DeviceReport> reports(const std::vector<at::Device>& devices,
                                  const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<DeviceReport> out;
  for (size_t k = 0; k < modules.size(); ++k) {
    out.push_back({devices[k].str(), count(modules[k]->parameters()), peak_memory(devices[k])});
  }
  return out;
}

LossFn weighted(const LossFn& loss, double weight) {
  if (weight == 1) return loss;
  return
      [loss, weight](const at::Tensor& out, const at::Tensor& y) { return loss(out, y) * weight; };
}

// DistributedDataParallel over the ranks, one device each; mixed precision with a GradScaler.
class DdpStrategy : public TrainStrategy {
 public:
  DdpStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model)
      : TrainStrategy(d),
        model_(model),
        loss_(task.loss),
        dev_(rank_device(o.device, d)),
        amp_(o.amp != Amp::kNone),
        fp16_(o.amp == Amp::kFp16),
        amp_dtype_(o.amp == Amp::kFp16 ? at::kHalf : at::kBFloat16),
        scaler_([&] {
          GradScalerOptions so;
          so.enabled = o.amp == Amp::kFp16;  // bf16 has fp32's range: no scaling
          return so;
        }()) {
    model.module->to(dev_);
    ddp_ = std::make_unique<DistributedDataParallel>(model.module, d, o.ddp);
  }

  std::vector<at::Tensor> parameters() override { return model_.module->parameters(); }
  int data_rank() const override { return dist_.rank(); }
  int data_replicas() const override { return dist_.size(); }
  at::Device device() const override { return dev_; }

  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool sync, double weight) override {
    std::optional<DistributedDataParallel::NoSync> local;
    if (!sync) local.emplace(*ddp_);
    at::Tensor out;
    {
      std::optional<Autocast> autocast;
      if (amp_) autocast.emplace(dev_.type(), amp_dtype_);
      out = ddp_->forward([&] { return model_.forward(x); });
    }
    at::Tensor loss = loss_(amp_ ? out.to(at::kFloat) : out, y);
    scaler_.scale(weight != 1 ? loss * weight : loss).backward();
    return loss.detach();
  }

  at::Tensor predict(const at::Tensor& x) override { return model_.forward(x); }
  bool gradients_finite() override {
    return fp16_ || TrainStrategy::gradients_finite();  // fp16: the scaler skips such steps
  }
  at::Tensor gradients_finite_flag() override {  // averaged gradients: the same on every rank
    if (fp16_) return {};                        // the scaler checks, and skips such steps
    std::vector<at::Tensor> grads;
    for (auto& p : model_.module->parameters()) {
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
  void optimizer_step(torch::optim::Optimizer& opt) override {
    scaler_.step(opt);  // skips a step whose gradients overflowed (fp16)
    scaler_.update();
  }
  void zero_grad(torch::optim::Optimizer&) override { ddp_->zero_grad(); }  // keeps the views
  void end_epoch() override { ddp_->join(); }
  void train_mode(bool on) override { model_.module->train(on); }
  GradScaler* scaler() override { return &scaler_; }
  std::vector<DeviceReport> devices() const override {
    return {{dev_.str(), count(model_.module->parameters()), peak_memory(dev_)}};
  }

 private:
  Model& model_;
  LossFn loss_;
  at::Device dev_;
  bool amp_, fp16_;
  at::ScalarType amp_dtype_;
  GradScaler scaler_;
  std::unique_ptr<DistributedDataParallel> ddp_;
};

// DataParallel in one process: the model is the primary replica; the task builds the others.
class DpStrategy : public TrainStrategy {
 public:
  DpStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model)
      : TrainStrategy(d),
        model_(model),
        loss_(task.loss),
        devices_(local_devices(o)),
        threads_(share_cores(devices_)) {
    std::vector<DataParallel::Replica> replicas{{model.module, model.forward}};
    for (size_t k = 1; k < devices_.size(); ++k) {
      Model other = task.model();
      replicas.push_back({other.module, other.forward});
      others_.push_back(other);  // keeps what the forward of the replica captures
    }
    dp_ = std::make_unique<DataParallel>(std::move(replicas), devices_);
  }

  std::vector<at::Tensor> parameters() override { return model_.module->parameters(); }
  int data_rank() const override { return 0; }
  int data_replicas() const override { return 1; }
  at::Device device() const override { return devices_[0]; }
  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool, double weight) override {
    return dp_->train_step(x, y, weighted(loss_, weight)) / weight;  // the batch's own loss
  }
  at::Tensor predict(const at::Tensor& x) override { return dp_->forward(x); }
  void train_mode(bool on) override {
    for (auto& r : dp_->replicas()) r->train(on);
  }
  std::vector<DeviceReport> devices() const override { return reports(devices_, dp_->replicas()); }

 private:
  Model& model_;
  LossFn loss_;
  std::vector<at::Device> devices_;
  std::unique_ptr<IntraOpThreads> threads_;
  std::vector<Model> others_;
  std::unique_ptr<DataParallel> dp_;
};

// A pipeline in one process over the model's blocks.
class PipelineStrategy : public TrainStrategy {
 public:
  PipelineStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model,
                   const at::Tensor& sample)
      : TrainStrategy(d),
        model_(model),
        loss_(task.loss),
        devices_(local_devices(o)),
        threads_(share_cores(devices_)) {
    torch::nn::Sequential chain = chain_of(model, Strategy::kPipeline);
    const auto p = o.pipeline.resolved();  // the pipeline's options, defaults filled in
    PipelineOptions po;
    po.devices = devices_;
    po.stages_per_device = p.stages_per_device;
    po.balance = resolve_balance(p.balance, chain,
                                 static_cast<int>(devices_.size()) * p.stages_per_device, sample);
    po.chunks = p.chunks > 0 ? p.chunks : 2 * static_cast<int>(devices_.size());
    po.split_size = p.split_size;
    po.schedule = p.schedule;
    po.checkpoint = p.checkpoint;
    pipe_ = std::make_unique<Pipeline>(chain, po);
  }

  std::vector<at::Tensor> parameters() override { return model_.module->parameters(); }
  int data_rank() const override { return 0; }
  int data_replicas() const override { return 1; }
  at::Device device() const override { return devices_[0]; }
  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool, double weight) override {
    return pipe_->train_step(x, y, weighted(loss_, weight)) / weight;  // the batch's own loss
  }
  at::Tensor predict(const at::Tensor& x) override { return pipe_->forward(x); }
  void train_mode(bool on) override { model_.module->train(on); }
  std::vector<DeviceReport> devices() const override {
    // A device's modules: its stage, or with interleaving its stages k, k + p, ...
    std::vector<std::shared_ptr<torch::nn::Module>> per_device;
    const auto& stages = pipe_->stages();
    for (size_t d = 0; d < devices_.size(); ++d) {
      if (stages.size() == devices_.size()) {
        per_device.push_back(stages[d].ptr());
        continue;
      }
      auto mine = std::make_shared<torch::nn::Module>();
      for (size_t k = d; k < stages.size(); k += devices_.size()) {
        mine->register_module("stage" + std::to_string(k), stages[k].ptr());
      }
      per_device.push_back(mine);
    }
    return reports(devices_, per_device);
  }

 private:
  Model& model_;
  LossFn loss_;
  std::vector<at::Device> devices_;
  std::unique_ptr<IntraOpThreads> threads_;
  std::unique_ptr<Pipeline> pipe_;
};

}  // namespace

std::unique_ptr<TrainStrategy> make_grid_strategy(const TrainTask& task,
                                                  const TrainerOptions& options, const Dist& dist,
                                                  Model& model, const at::Tensor& sample);

std::unique_ptr<TrainStrategy> make_zero_strategy(const TrainTask& task,
                                                  const TrainerOptions& options, const Dist& dist,
                                                  Model& model, int stage);

std::unique_ptr<TrainStrategy> make_tensor_parallel_strategy(const TrainTask& task,
                                                             const TrainerOptions& options,
                                                             const Dist& dist, Model& model);

std::unique_ptr<TrainStrategy> make_strategy(const TrainTask& task, const TrainerOptions& options,
                                             const Dist& dist, Model& model,
                                             const at::Tensor& sample) {
  switch (options.strategy) {
    case Strategy::kDDP:
      if (options.tensor_parallel.size > 1) {
        return make_tensor_parallel_strategy(task, options, dist, model);
      }
      return std::make_unique<DdpStrategy>(task, options, dist, model);
    case Strategy::kDataParallel:
      return std::make_unique<DpStrategy>(task, options, dist, model);
    case Strategy::kPipeline:
      return std::make_unique<PipelineStrategy>(task, options, dist, model, sample);
    case Strategy::kGrid:
      return make_grid_strategy(task, options, dist, model, sample);
    case Strategy::kZero1:
    case Strategy::kZero2:
      if (options.tensor_parallel.size > 1) {  // ZeRO over dp, the model split over tp
        return make_tensor_parallel_strategy(task, options, dist, model);
      }
      return make_zero_strategy(task, options, dist, model,
                                options.strategy == Strategy::kZero1 ? 1 : 2);
    case Strategy::kFsdp:
      // Regression (FsdpIgnoredTensorParallelism): --strategy fsdp --tp T trained unsplit.
      if (options.tensor_parallel.size > 1) {  // FSDP over dp, the model split over tp
        return make_tensor_parallel_strategy(task, options, dist, model);
      }
      return make_zero_strategy(task, options, dist, model, 3);
  }
  throw Error("unknown strategy");
}

}  // namespace scaletrain
