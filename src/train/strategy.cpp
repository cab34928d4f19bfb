// Note [Strategies]
// ~~~~~~~~~~~~~~~~~
// The trainer's loop (trainer.cpp) is one for every strategy; a strategy says what a step is on
// this rank and what the rank holds:
//
//   strategy  processes       a rank holds                      its optimizer steps
//   ddp       one per device  the model, DDP over the ranks     the model's parameters
//   dp        one             a replica per device (primary     the primary's = the model's
//                             = the model)
//   pipeline  one             the model's blocks, in stages     the model's (the blocks share
//                             over the devices                  its tensors)
//   grid      stages x        one stage of one pipeline; DDP    its stage's parameters
//             replicas        over that stage's replicas (the
//                             mesh {dp, pp}, mesh.h)
//   zero1     one per device  the model; the optimizer state    its shard of every unit
//                             sharded over the ranks (zero.h)
//   zero2     one per device  ... and the gradients             its shard of every unit
//   fsdp      one per device  ... and the parameters: units     its shard of every unit
//                             gathered for their forward and
//                             backward only
//
// In ddp, dp and pipeline, one optimizer covers the model's parameters in the model's order, so
// their checkpoints are interchangeable, optimizer state included: a run trained with one
// resumes with another exactly where it left off. The sharded three keep the optimizer state
// over the whole model, flat, in the checkpoint (zero_strategy.cpp), so they resume at any world
// size and stage; --checkpoint-format sharded writes a file per rank instead. A grid keeps an
// optimizer per stage; its checkpoint holds the whole model's weights (gathered from the stages)
// and each stage's optimizer state, so it resumes exactly as a grid of the same stages, and as any
// other strategy with its weights (the optimizer starting afresh, which the trainer says).

#include "train/strategy.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/stack.h>
#include <sys/resource.h>
#include <torch/nn/functional/loss.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>

#include "scaletrain/data_parallel.h"
#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/intra_op_threads.h"
#include "scaletrain/tensor_parallel.h"
#include "scaletrain/version.h"
#include "train/balance.h"

#ifdef SCALETRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace scaletrain {

at::Device rank_device(const std::string& name, const Dist& d) {
  const int gpus = cuda_device_count();
  if (name == "cpu" || (name == "auto" && gpus == 0)) return at::kCPU;
  if (gpus == 0) {
    throw UsageError("--device " + name + " on rank " + std::to_string(d.rank()) +
                     ", but no GPU is visible; use --device cpu");
  }
  if (name == "auto" || name == "cuda")
    return {at::kCUDA, static_cast<int8_t>(d.world.local_rank % gpus)};
  at::Device dev(name);
  if (dev.index() >= gpus) {
    throw UsageError("--device " + name + ": this node has " + std::to_string(gpus) + " GPU(s)");
  }
  return dev;
}

std::vector<at::Device> local_devices(const TrainerOptions& o) {
  std::vector<at::Device> out;
  for (const auto& name : o.devices) out.emplace_back(name);
  if (!out.empty()) return out;
  const int gpus = cuda_device_count();
  if (gpus >= 2) {
    for (int i = 0; i < gpus; ++i) out.emplace_back(at::kCUDA, static_cast<int8_t>(i));
    return out;
  }
  return {at::kCPU, at::kCPU};
}

int64_t peak_memory(const at::Device& dev) {
#ifdef SCALETRAIN_WITH_CUDA
  if (dev.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .peak;
  }
#endif
  (void)dev;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // the process's peak resident memory
}

// One flag per tensor, gathered on the first one's device: one wait for the host, not one per
// tensor (regression OneDeviceSyncPerParameter: each flag was copied to the CPU on its own, and
// on a GPU every copy waited for the device, 62 waits per step of a ResNet-18).
at::Tensor all_finite_flag(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flags;
  for (const auto& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    auto flag = at::isfinite(t).all();
    flags.push_back(flags.empty() ? flag : flag.to(flags.front().device()));
  }
  return flags.empty() ? at::ones({}, at::kBool) : at::stack(flags).all();
}

bool all_finite(const std::vector<at::Tensor>& tensors) {
  return all_finite_flag(tensors).item<bool>();
}

bool TrainStrategy::gradients_finite() {
  std::vector<at::Tensor> grads;
  for (auto& p : parameters()) grads.push_back(p.grad());
  return all_finite(grads);  // averaged gradients: the same bits on every rank
}

at::Tensor optimizer_bytes(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive ar;
  opt.save(ar);
  std::ostringstream out;
  ar.save_to(out);
  const std::string s = out.str();
  auto t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

void load_optimizer_bytes(torch::optim::Optimizer& opt, const at::Tensor& bytes) {
  const auto t = bytes.contiguous();
  std::istringstream in(
      std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel())));
  torch::serialize::InputArchive ar;
  ar.load_from(in);
  opt.load(ar);
}

std::vector<at::Tensor> bytes_to_rank_zero(const Dist& dist, const at::Tensor& mine, int senders,
                                           int tag, const at::Device& device) {
  if (dist.rank() != 0) {
    dist.send(at::full({1}, mine.numel(), at::kLong).to(device), 0, tag, "bytes' size to rank 0");
    dist.send(mine.to(device), 0, tag + 1, "bytes to rank 0");
    return {};
  }
  std::vector<at::Tensor> out = {mine};
  for (int r = 1; r < senders; ++r) {
    const std::string from = " from rank " + std::to_string(r);
    auto size = at::empty({1}, at::TensorOptions(at::kLong).device(device));
    dist.recv(size, r, tag, "bytes' size" + from);
    auto bytes =
        at::empty({size.cpu().item<int64_t>()}, at::TensorOptions(at::kByte).device(device));
    dist.recv(bytes, r, tag + 1, "bytes" + from);
    out.push_back(bytes.cpu());
  }
  return out;
}

double square_sum(const std::vector<at::Tensor>& tensors) {
  std::map<std::string, std::vector<at::Tensor>> by_device;  // one sync per device
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      by_device[t.device().str()].push_back(t.to(at::kDouble).square().sum());
    }
  }
  double sum = 0;
  for (auto& [device, parts] : by_device) sum += at::stack(parts).sum().item<double>();
  return sum;
}

double sum_over(const Dist& dist, double mine, const at::Device& device) {
  auto sum = at::full({1}, mine, at::TensorOptions().dtype(at::kDouble).device(device));
  dist.all_reduce(sum);
  return sum.item<double>();
}

bool on_every_rank(const Dist& dist, bool mine, const at::Device& device) {
  auto ok = at::full({1}, mine ? 1.0 : 0.0, at::TensorOptions().device(device));
  dist.all_reduce(ok, ReduceOp::MIN);
  return ok.item<double>() > 0.5;
}

at::Tensor flat_copy(const std::vector<at::Tensor>& tensors, const at::Device& device) {
  std::vector<at::Tensor> parts;
  parts.reserve(tensors.size());
  for (const auto& t : tensors) parts.push_back(t.detach().to(device).reshape({-1}));
  return at::cat(parts);
}

void copy_from_flat(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

void broadcast_parameters(torch::nn::Module& module, const Dist& dist, const at::Device& device) {
  std::vector<at::Tensor> params = module.parameters();
  auto flat = flat_copy(params, device);
  dist.broadcast(flat, 0);
  torch::NoGradGuard no_grad;
  copy_from_flat(flat, params);
}

void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto source = from.named_parameters();
  for (auto& p : to.named_parameters()) p.value().copy_(source[p.key()]);
}

std::map<std::string, at::Tensor> named_values(torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) out[p.key()] = p.value().detach();
  return out;
}

Model split_build(const TrainTask& task, Model& whole, const Dist& world, const Dist& tp,
                  bool sequence_parallel, const at::Device& device) {
  Model split = task.model();
  if (!split.parallelize) {
    throw UsageError("tensor parallelism: model '" + split.name +
                     "' cannot be split (its Model has no parallelize; build its linear layers "
                     "as ParallelLinear and give Model::parallelize, tensor_parallel.h)");
  }
  broadcast_parameters(*whole.module, world, device);  // rank 0's weights everywhere
  copy_parameters(*whole.module, *split.module);
  split.parallelize(tp, sequence_parallel);  // then this rank's slices of them
  return split;
}

std::set<const void*> replicated_set(torch::nn::Module& split) {
  std::set<const void*> out;
  for (const auto& p : replicated_parameters(split)) out.insert(p.unsafeGetTensorImpl());
  return out;
}

double tp_square_sum(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& parts,
                     const std::set<const void*>& replicated, int t) {
  std::vector<at::Tensor> split, whole;
  for (size_t i = 0; i < params.size(); ++i) {
    (replicated.count(params[i].unsafeGetTensorImpl()) ? whole : split).push_back(parts[i]);
  }
  return square_sum(split) + square_sum(whole) / t;
}

double TrainStrategy::gradient_square_sum() {
  std::vector<at::Tensor> grads;
  for (auto& p : parameters()) grads.push_back(p.grad());
  return square_sum(grads);
}

double TrainStrategy::clip_gradients(double max_norm) {
  const double norm = std::sqrt(gradient_square_sum());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return norm;
}

const torch::optim::Optimizer* TrainStrategy::saved_optimizer(torch::optim::Optimizer& opt,
                                                              TrainingState&) {
  return &opt;
}

std::string TrainStrategy::save_sharded(const std::string&, const TrainingState&,
                                        const torch::optim::Optimizer&, int, AsyncCheckpointer*) {
  throw UsageError(
      "sharded checkpoints are written by the sharded strategies (zero1, zero2, "
      "fsdp) only");
}

TrainingState TrainStrategy::load_sharded(const std::string& dir, int64_t step,
                                          torch::optim::Optimizer&) {
  throw UsageError("the newest checkpoint in '" + dir + "' is sharded (step " +
                   std::to_string(step) +
                   "): resume it with a sharded strategy (zero1, zero2 or fsdp, at any world "
                   "size), or start afresh");
}

bool TrainStrategy::weights_finite() { return all_finite(parameters()); }

bool TrainStrategy::restore_optimizer(torch::optim::Optimizer&, const TrainingState& state) {
  return state.optimizer_restored;
}

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
        amp_(o.amp != "none"),
        fp16_(o.amp == "fp16"),
        amp_dtype_(o.amp == "fp16" ? at::kHalf : at::kBFloat16),
        scaler_([&] {
          GradScalerOptions so;
          so.enabled = o.amp == "fp16";  // bf16 has fp32's range: no scaling
          return so;
        }()) {
    model.module->to(dev_);
    DDPOptions ddpo;
    ddpo.uneven_inputs = o.uneven_inputs == "join" ? UnevenInputs::kJoin : UnevenInputs::kFail;
    ddp_ = std::make_unique<DistributedDataParallel>(model.module, d, ddpo);
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
    return dp_->train_step(x, y, weighted(loss_, weight));
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
    torch::nn::Sequential chain = chain_of(model);
    PipelineOptions po;
    po.devices = devices_;
    po.stages_per_device = o.stages_per_device;
    po.balance = resolve_balance(o.balance, chain,
                                 static_cast<int>(devices_.size()) * o.stages_per_device, sample);
    po.chunks = o.chunks > 0 ? o.chunks : 2 * static_cast<int>(devices_.size());
    po.split_size = o.split_size;
    po.schedule = o.schedule;
    po.checkpoint = o.checkpointing;
    pipe_ = std::make_unique<Pipeline>(chain, po);
  }

  std::vector<at::Tensor> parameters() override { return model_.module->parameters(); }
  int data_rank() const override { return 0; }
  int data_replicas() const override { return 1; }
  at::Device device() const override { return devices_[0]; }
  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool, double weight) override {
    return pipe_->train_step(x, y, weighted(loss_, weight));
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
      if (options.tensor_parallel > 1) {
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
      if (options.tensor_parallel > 1) {  // ZeRO over dp, the model split over tp
        return make_tensor_parallel_strategy(task, options, dist, model);
      }
      return make_zero_strategy(task, options, dist, model,
                                options.strategy == Strategy::kZero1 ? 1 : 2);
    case Strategy::kFsdp:
      return make_zero_strategy(task, options, dist, model, 3);
  }
  throw Error("unknown strategy");
}

}  // namespace scaletrain
