#include "scaletrain/data_parallel.h"

#include "runtime/device_threads.h"
#include "scaletrain/error.h"
#include "scaletrain/pipeline.h"

namespace scaletrain {

// Runs fn(k) for the first n replicas, each on its device's thread (kept across steps); the first
// failure is raised here.
void DataParallel::on_each(size_t n, const std::function<void(size_t)>& fn) {
  if (!threads_) threads_ = std::make_shared<DeviceThreads>(devices_, false);
  threads_->run_or_throw(
      fn, [](size_t k) { return "DataParallel replica " + std::to_string(k); }, n);
}

void DataParallel::check_devices(const std::vector<at::Device>& devices) {
  if (devices.empty()) throw UsageError("DataParallel needs at least one device");
}

void DataParallel::not_cloneable() {
  throw UsageError(
      "DataParallel: the module's type is not torch::nn::Cloneable, so it cannot be copied onto "
      "the other devices; give a factory that builds one of the same architecture, "
      "DataParallel(module, [] { return std::make_shared<Net>(); }, devices), or derive the "
      "module from torch::nn::Cloneable<NetImpl>");
}

DataParallel::DataParallel(std::vector<Replica> replicas, std::vector<at::Device> devices)
    : replicas_(std::move(replicas)), devices_(std::move(devices)) {
  const auto shapes = [](const torch::nn::Module& m) {
    std::vector<std::vector<int64_t>> out;
    for (const auto& p : m.parameters()) out.push_back(p.sizes().vec());
    return out;
  };
  for (size_t k = 0; k < replicas_.size(); ++k) {
    replicas_[k].module->to(devices_[k]);
    if (k > 0 && shapes(*replicas_[k].module) != shapes(*replicas_[0].module)) {
      throw UsageError("DataParallel: replica " + std::to_string(k) +
                       " has other parameters than the primary (count or shapes); the factory "
                       "must build the module's architecture");
    }
  }
  sync_replicas();
}

DataParallel::DataParallel(const std::function<torch::nn::Sequential()>& make,
                           std::vector<at::Device> devices)
    : DataParallel(
          [&] {
            check_devices(devices);
            std::vector<Replica> out;
            for (size_t k = 0; k < devices.size(); ++k) out.push_back(replica_of(make().ptr()));
            return out;
          }(),
          devices) {}

std::vector<std::shared_ptr<torch::nn::Module>> DataParallel::replicas() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& r : replicas_) out.push_back(r.module);
  return out;
}

void DataParallel::sync_replicas() {
  torch::NoGradGuard no_grad;
  auto params = replicas_[0].module->parameters();
  auto buffers = replicas_[0].module->buffers();
  for (size_t k = 1; k < replicas_.size(); ++k) {
    auto p = replicas_[k].module->parameters();
    for (size_t i = 0; i < p.size(); ++i) p[i].copy_(params[i]);
    auto b = replicas_[k].module->buffers();
    for (size_t i = 0; i < b.size(); ++i) b[i].copy_(buffers[i]);
  }
}

at::Tensor DataParallel::forward(const at::Tensor& input) {
  sync_replicas();
  auto xs = split_microbatches(input, static_cast<int>(replicas_.size()));
  std::vector<at::Tensor> outs(xs.size());
  on_each(xs.size(),
          [&](size_t k) { outs[k] = replicas_[k].forward(xs[k].to(devices_[k])).to(devices_[0]); });
  return at::cat(outs);
}

at::Tensor DataParallel::train_step(
    const at::Tensor& input, const at::Tensor& target,
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss_fn) {
  sync_replicas();
  auto xs = split_microbatches(input, static_cast<int>(replicas_.size()));
  auto ys = split_microbatches(target, static_cast<int>(replicas_.size()));
  const double total = static_cast<double>(input.size(0));
  std::vector<at::Tensor> losses(xs.size());
  // Replicas other than the primary start each step from empty gradients.
  for (size_t k = 1; k < replicas_.size(); ++k) {
    for (auto& p : replicas_[k].module->parameters()) p.mutable_grad() = at::Tensor();
  }
  on_each(xs.size(), [&](size_t k) {
    const double share = static_cast<double>(xs[k].size(0)) / total;
    auto out = replicas_[k].forward(xs[k].to(devices_[k]));
    losses[k] = loss_fn(out, ys[k].to(devices_[k])) * share;
    losses[k].backward();
  });
  torch::NoGradGuard no_grad;
  auto primary = replicas_[0].module->parameters();
  for (size_t k = 1; k < xs.size(); ++k) {
    auto p = replicas_[k].module->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      if (!p[i].grad().defined()) continue;
      auto g = p[i].grad().to(devices_[0]);
      if (primary[i].grad().defined()) {
        primary[i].mutable_grad().add_(g);
      } else {
        primary[i].mutable_grad() = g.clone();
      }
    }
  }
  at::Tensor sum = losses[0].detach().to(devices_[0]);
  for (size_t k = 1; k < losses.size(); ++k) sum = sum + losses[k].detach().to(devices_[0]);
  return sum;
}

}  // namespace scaletrain
