// The strategies of one process (Note [Strategies] in strategy.cpp): dp (DataParallel's
// replicas) and pipeline (the model's blocks in stages over devices); and make_strategy(), which
// picks any strategy from the options.

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

// One process over its devices, whose optimizer steps the whole model's parameters: the
// default state (strategy_state.h), all of it on this rank, the data whole.
class LocalStrategy : public TrainStrategy, StrategyState {
 public:
  std::vector<at::Tensor> parameters() override { return model_.module->parameters(); }
  StrategyState& state() override { return *this; }
  bool weights_finite() override { return all_finite(parameters()); }

 protected:
  LocalStrategy(const TrainerOptions& o, const Dist& d, Model& model)
      : TrainStrategy(d), model_(model), devices_(local_devices(o)) {
    place({devices_[0], 0, 1, true});
  }
  Model& model_;
  std::vector<at::Device> devices_;
};

// DataParallel in one process: the model is the primary replica; the task builds the others.
class DpStrategy : public LocalStrategy {
 public:
  DpStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model)
      : LocalStrategy(o, d, model), loss_(task.loss), threads_(share_cores(devices_)) {
    std::vector<DataParallel::Replica> replicas{{model.module, model.forward}};
    for (size_t k = 1; k < devices_.size(); ++k) {
      Model other = task.model();
      replicas.push_back({other.module, other.forward});
      others_.push_back(other);  // keeps what the forward of the replica captures
    }
    dp_ = std::make_unique<DataParallel>(std::move(replicas), devices_);
  }

  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool, double weight) override {
    return dp_->train_step(x, y, weighted(loss_, weight)) / weight;  // the batch's own loss
  }
  at::Tensor predict(const at::Tensor& x) override { return dp_->forward(x); }
  void train_mode(bool on) override {
    for (auto& r : dp_->replicas()) r->train(on);
  }
  std::vector<DeviceReport> devices() const override { return reports(devices_, dp_->replicas()); }

 private:
  LossFn loss_;
  std::unique_ptr<IntraOpThreads> threads_;
  std::vector<Model> others_;
  std::unique_ptr<DataParallel> dp_;
};

// A pipeline in one process over the model's blocks.
class PipelineStrategy : public LocalStrategy {
 public:
  PipelineStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model,
                   const at::Tensor& sample)
      : LocalStrategy(o, d, model), loss_(task.loss), threads_(share_cores(devices_)) {
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
  LossFn loss_;
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

std::unique_ptr<TrainStrategy> make_ddp_strategy(const TrainTask& task,
                                                 const TrainerOptions& options, const Dist& dist,
                                                 Model& model);

// Tensor parallelism, where given, is applied inside the data-parallel strategies, first (Note
// [Tensor parallelism applied first] in tp_apply.h); the grid applies it to each stage.
// Regression (FsdpIgnoredTensorParallelism): --strategy fsdp --tp T trained unsplit.
std::unique_ptr<TrainStrategy> make_strategy(const TrainTask& task, const TrainerOptions& options,
                                             const Dist& dist, Model& model,
                                             const at::Tensor& sample) {
  switch (options.strategy) {
    case Strategy::kDDP:
      return make_ddp_strategy(task, options, dist, model);
    case Strategy::kDataParallel:
      return std::make_unique<DpStrategy>(task, options, dist, model);
    case Strategy::kPipeline:
      return std::make_unique<PipelineStrategy>(task, options, dist, model, sample);
    case Strategy::kGrid:
      return make_grid_strategy(task, options, dist, model, sample);
    case Strategy::kZero1:
      return make_zero_strategy(task, options, dist, model, 1);
    case Strategy::kZero2:
      return make_zero_strategy(task, options, dist, model, 2);
    case Strategy::kFsdp:
      return make_zero_strategy(task, options, dist, model, 3);
  }
  throw Error("unknown strategy");
}

}  // namespace scaletrain
